"""An LLMEngine stepped by a background thread while asyncio handlers add and abort requests.

The engine is not thread-safe, so one thread owns it. Handlers send it commands (add, abort) through a
queue; between two steps it takes every command that arrived, so requests from all HTTP clients join the
running batch at the next step (continuous batching). After a step it hands the outputs to the event
loop, which puts each into its request's stream.

Failure rules: a request the engine rejects (a ValueError from add_request) fails alone, its caller gets
the exception; an exception from a step leaves the engine in an unknown state, so every in-flight request
fails with EngineDeadError, later requests are refused at once, and `check_health` reports it (as it reports a
tensor-parallel worker that died while the engine was idle).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tritonllm.outputs import RequestOutput
from tritonllm.runtime.errors import EngineDeadError  # noqa: F401  (re-exported: the server's handlers catch it)

if TYPE_CHECKING:
    from tritonllm.entrypoints.openai.metrics import EngineMetrics
    from tritonllm.runtime.engine import LLMEngine
    from tritonllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ServerShuttingDownError(EngineDeadError):
    """The server is stopping: requests still open end with this (503) rather than an engine failure (500)."""


class RequestStream:
    """The outputs of one request, in order, as an async iterator.

    Outputs are cumulative (each holds the whole text and token list so far), so a consumer that falls
    behind gets the latest one instead of a backlog. Iteration ends after the finished output, or raises
    the engine's error. `abort()` stops the request and frees its KV blocks (no-op once finished).
    """

    def __init__(self, request_id: str, engine: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    stream: RequestStream
    admitted: concurrent.futures.Future
    arrival: float


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Tracked:
    """Engine-thread bookkeeping of one admitted request, for delivery and latency metrics."""

    stream: RequestStream
    arrival: float
    last_token_time: float | None = None
    num_tokens: int = 0
    finish_reasons: list[str | None] = field(default_factory=list)


_STOP = object()


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.dead_error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- event-loop side --------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on `loop` (default: the running loop)."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already running")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tritonllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)
        self._thread.join(timeout)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    def check_health(self) -> None:
        """Raise EngineDeadError unless the engine thread is alive and the engine has not failed."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine failed: {type(self.dead_error).__name__}: {self.dead_error}")
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        try:
            self.engine.check_health()  # a tensor-parallel worker that died while the engine was idle
        except EngineDeadError as e:
            raise EngineDeadError(f"the engine failed: {e}") from None

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> RequestStream:
        """Queue a request and wait until the engine has admitted it. Raises what `LLMEngine.add_request`
        raises (ValueError for a request it could never run), or EngineDeadError."""
        self.check_health()
        stream = RequestStream(request_id, self)
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Add(request_id, prompt, params, stream, admitted, time.perf_counter()))
        try:
            await asyncio.wrap_future(admitted)
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add: dropped as soon as it is admitted
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks at the engine's next chance (thread-safe, never blocks)."""
        self._commands.put(_Abort(request_id))

    def _deliver(self, items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        for stream, item in items:
            stream._put(item)

    def _send(self, items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        if not items:
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver, items)
        except RuntimeError:  # the event loop is closed: the server is going away
            pass

    # ---- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            busy = self.dead_error is None and self.engine.has_unfinished_requests()
            commands = [self._commands.get()] if not busy else []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            if _STOP in commands:
                error = ServerShuttingDownError("the server is shutting down")
                self._reject_adds(commands, error)
                self._fail_all(error)
                return
            try:
                for command in commands:
                    self._handle(command)
                if self.dead_error is None and self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                if self.metrics is not None and self.dead_error is None:
                    self.metrics.update_engine_state(self.engine)
            except Exception as e:  # noqa: BLE001  (whatever broke, no request may wait forever)
                logger.exception("engine step failed; failing every in-flight request")
                self.dead_error = e
                error = EngineDeadError(f"the engine failed: {type(e).__name__}: {e}")
                self._reject_adds(commands, error)  # arrivals of this round not handled yet
                self._fail_all(error)

    def _handle(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            tracked = self._tracked.pop(command.request_id, None)
            if tracked is not None:
                self.engine.abort_request(command.request_id)
                if self.metrics is not None:
                    self.metrics.observe_request_finished(["abort"], time.perf_counter() - tracked.arrival)
            return
        if not command.admitted.set_running_or_notify_cancel():
            return  # the caller gave up before admission: nothing to run
        if self.dead_error is not None:
            command.admitted.set_exception(EngineDeadError(f"the engine failed: {self.dead_error}"))
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params)
        except Exception as e:  # noqa: BLE001  (a rejected request fails alone; add_request changed nothing)
            command.admitted.set_exception(e)
            return
        self._tracked[command.request_id] = _Tracked(command.stream, command.arrival)
        command.admitted.set_result(None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        items: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:  # aborted meanwhile
                continue
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            if num_tokens > tracked.num_tokens and self.metrics is not None:
                if tracked.last_token_time is None:
                    self.metrics.time_to_first_token.observe(now - tracked.arrival)
                else:
                    self.metrics.inter_token_latency.observe(now - tracked.last_token_time)
            if num_tokens > tracked.num_tokens:
                tracked.num_tokens, tracked.last_token_time = num_tokens, now
            if out.finished:
                del self._tracked[out.request_id]
                if self.metrics is not None:
                    reasons = [c.finish_reason for c in out.outputs]
                    self.metrics.observe_request_finished(reasons, now - tracked.arrival)
            items.append((tracked.stream, out))
        self._send(items)

    @staticmethod
    def _reject_adds(commands: list, error: BaseException) -> None:
        for command in commands:
            if not isinstance(command, _Add) or command.admitted.done():
                continue
            if command.admitted.running() or command.admitted.set_running_or_notify_cancel():
                command.admitted.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        items = [(t.stream, error) for t in self._tracked.values()]
        for request_id in list(self._tracked):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001  (best effort: the engine may be broken)
                pass
        self._tracked.clear()
        self._send(items)
