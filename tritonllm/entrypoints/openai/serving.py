"""What the completion and chat handlers share: the served model, request checks, sampling parameters,
admission of a request's prompts, merged streams, server-sent events and cancellation on disconnect."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from tritonllm.entrypoints.openai.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestStream,
    ServerShuttingDownError,
)
from tritonllm.entrypoints.openai.errors import OpenAIError, invalid_request, model_not_found, server_error
from tritonllm.entrypoints.openai.protocol import SamplingRequest
from tritonllm.outputs import RequestOutput
from tritonllm.runtime.tokenizer import Tokenizer
from tritonllm.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # top tokens a request may ask for per position, as vLLM's default max_logprobs
SSE_DONE = "data: [DONE]\n\n"


@dataclass(slots=True)
class ServingContext:
    engine: AsyncLLMEngine
    served_model_names: list[str]
    model_path: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int

    def check_model(self, name: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if name is None:
            return self.served_model_names[0]
        if name not in self.served_model_names:
            raise model_not_found(name, self.served_model_names)
        return name

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", param=param)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_common(req: SamplingRequest) -> None:
    """Reject what this server does not do rather than silently answering something else."""
    if req.logit_bias:
        raise OpenAIError("logit_bias is not supported", param="logit_bias")
    if req.best_of is not None and req.best_of != req.n:
        raise OpenAIError("best_of is not supported (other than best_of == n)", param="best_of")
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options is only allowed when stream is true", param="stream_options")


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, what: str = "prompt") -> int:
    """max_tokens for the engine: the request's (which must fit in the context with the prompt), or all
    the context the prompt leaves when the request sets none."""
    room = max_model_len - prompt_len
    if requested is not None and requested < 1:
        raise OpenAIError(f"max_tokens must be >= 1, got {requested}", param="max_tokens")
    if room < 1 or (requested is not None and requested > room):
        wanted = prompt_len + (requested or 0)
        completion = f", {requested} in the completion" if requested is not None else ""
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {wanted} "
            f"tokens ({prompt_len} in the {what}{completion}). Please reduce the length of the {what} or "
            "of the completion.",
            param="max_tokens" if requested is not None and prompt_len < max_model_len else what,
            code="context_length_exceeded",
        )
    return room if requested is None else requested


def sampling_params(
    req: SamplingRequest, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise OpenAIError(f"{name} must lie in [0, {MAX_LOGPROBS}], got {value}", param=name)

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    try:
        return SamplingParams(
            n=req.n,
            temperature=pick(req.temperature, 1.0),
            top_p=pick(req.top_p, 1.0),
            top_k=pick(req.top_k, -1),
            min_p=pick(req.min_p, 0.0),
            presence_penalty=pick(req.presence_penalty, 0.0),
            frequency_penalty=pick(req.frequency_penalty, 0.0),
            repetition_penalty=pick(req.repetition_penalty, 1.0),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as e:
        raise invalid_request(e) from None


async def add_all(
    engine: AsyncLLMEngine, base_id: str, prompts: list[dict], params: list[SamplingParams]
) -> list[RequestStream]:
    """Admit one engine request per prompt, all or none: on a rejection the ones admitted are aborted."""
    streams: list[RequestStream] = []
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            streams.append(await engine.add_request(f"{base_id}-{i}", prompt, p))
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, ValueError):
            raise invalid_request(e) from None
        if isinstance(e, EngineDeadError):
            raise server_error(str(e), 503) from None
        raise
    return streams


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; the first error ends it all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                q.put_nowait((i, out, None))
        except Exception as e:  # noqa: BLE001  (handed to the consumer)
            q.put_nowait((i, None, e))
            return
        q.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, error = await q.get()
            if error is not None:
                raise error
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


def close_all(streams: list[RequestStream]) -> None:
    """Abort the streams still running (a client left, or the handler failed)."""
    for s in streams:
        s.abort()


def sse(payload: Any) -> str:
    """One server-sent event carrying a pydantic model or a dict as JSON."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def stream_failure(e: BaseException) -> str:
    """The error event that ends a stream whose headers are already sent (OpenAI clients raise on it)."""
    err = e if isinstance(e, OpenAIError) else engine_failure(e)
    return sse(err.body()) + SSE_DONE


def engine_failure(e: BaseException) -> OpenAIError:
    """An admitted request the engine could not finish: 500 with the engine's message (503 while shutting down)."""
    if isinstance(e, ServerShuttingDownError):
        return server_error(str(e), 503)
    if isinstance(e, EngineDeadError):
        return server_error(str(e), 500)
    return server_error(f"{type(e).__name__}: {e}")


async def _wait_for_disconnect(request: Request) -> None:
    # The body is read by now, so the next ASGI message can only be the client going away.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[Response], streams: list[RequestStream]) -> Response:
    """Run a non-streaming handler, cancelling it if the client disconnects; either way `streams` still
    running afterwards are aborted (a handler cancelled before it started has no finally of its own)."""
    handler = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():
            handler.cancel()
        close_all(streams)
    if handler.done() and not handler.cancelled():
        return handler.result()
    return Response(status_code=499)  # nobody is listening


def streaming_response(body: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    """Server-sent events from `body`; `streams` still running when the response ends (the client left,
    perhaps before `body` ever started) are aborted by a background task."""
    return StreamingResponse(body, media_type="text/event-stream", background=BackgroundTask(close_all, streams))
