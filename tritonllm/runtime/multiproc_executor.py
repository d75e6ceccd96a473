"""Tensor parallelism on one host: W spawned worker processes, one per rank.

    engine ──Pipe──▶ rank 0 ──tp_broadcast_object (gloo)──▶ ranks 1..W-1      a StepMessage, pickled once
    engine ◀──Pipe── rank 0                                                   a StepResult (tokens, logprobs)
    engine ◀──Pipe── rank r                                                   only "ready", or an error's traceback

The engine waits with `multiprocessing.connection.wait` on the pipes and every process's sentinel, so a worker
that exits for any reason (an exception, kill -9, the OOM killer) is noticed at once, even while its peers hang
in a collective: the executor then kills the others and raises EngineDeadError naming the rank, pid and exit code
(or carrying the worker's traceback). Workers ignore Ctrl-C (it reaches the whole process group); the engine
stops them: at `shutdown()`, when the executor is collected, or at interpreter exit.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import NoReturn

from tritonllm.distributed.communication import tp_broadcast_object
from tritonllm.distributed.parallel_state import destroy_tensor_parallel
from tritonllm.models.registry import registered_models, restore_registrations
from tritonllm.runtime.errors import EngineDeadError
from tritonllm.runtime.executor import Executor
from tritonllm.runtime.scheduler_output import SchedulerOutput
from tritonllm.runtime.step_messages import KEEPALIVE, SHUTDOWN, StepEncoder
from tritonllm.runtime.worker import StepResult, Worker, WorkerConfig

# An idle group's ranks block in a broadcast whose gloo timeout is 10 minutes: rank 0 pings them well before.
KEEPALIVE_SECONDS = 60.0
# After one rank fails, how long to wait for the others' exits before reading the group's state: a killed rank's
# peers fail in their next collective just after it, and the first death is the one to report.
_SETTLE_SECONDS = 0.5
_STOP_SECONDS = 10.0


class MultiprocExecutor(Executor):
    def __init__(self, config: WorkerConfig) -> None:
        world_size = config.engine.tensor_parallel_size
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        snapshot = registered_models()  # so that models registered in this process exist in every worker
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._dead: EngineDeadError | None = None
        self._errors: dict[int, str] = {}  # rank -> traceback text it sent
        self._encoder = StepEncoder()
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns)
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(config, rank, world_size, init_method, snapshot, child),
                name=f"tritonllm-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        info = self._wait_ready()
        self.num_blocks, self.dtype, self.device = info

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- steps ------------------------------------------------------------------------------------

    def execute_step(self, out: SchedulerOutput, prompt_logit_seq_ids: set[int]) -> StepResult:
        if self._dead is not None:
            raise self._dead
        if wait([p.sentinel for p in self._procs], timeout=0):  # one died between steps: it, not the step, failed
            self._fail("while the engine was idle")
        payload = pickle.dumps(self._encoder.encode(out, prompt_logit_seq_ids), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._conns[0].send_bytes(payload)
        except OSError:
            self._fail("while sending it a step")
        ready = wait([*self._conns, *(p.sentinel for p in self._procs)])
        if self._conns[0] in ready:
            reply = self._read(0)
            if reply is not None and reply[0] == "ok":
                return reply[1]
        self._fail("while running a step")

    def discard(self, seq_ids) -> None:
        self._encoder.discard(seq_ids)

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead
        for rank, proc in enumerate(self._procs):
            if proc.exitcode is not None:
                raise EngineDeadError(f"tensor-parallel worker {_exit_text(rank, proc)}")

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = EngineDeadError("the engine is shut down")
        self._finalizer()

    # ---- start-up and failures --------------------------------------------------------------------

    def _read(self, rank: int) -> tuple[str, object] | None:
        """The next message from `rank` (None if its pipe closed); an error's traceback is kept for _fail."""
        try:
            kind, value = pickle.loads(self._conns[rank].recv_bytes())
        except (EOFError, OSError):
            return None
        if kind == "error":
            self._errors[rank] = value
        return kind, value

    def _wait_ready(self) -> tuple:
        pending = set(range(len(self._procs)))
        info = None
        while pending:
            ready = wait([*(self._conns[r] for r in pending), *(p.sentinel for p in self._procs)])
            for rank in sorted(pending):
                if self._conns[rank] not in ready:
                    continue
                reply = self._read(rank)
                if reply is None or reply[0] != "ready":
                    self._fail("during start-up")
                info = info or reply[1]
                pending.discard(rank)
            if any(p.exitcode is not None for p in self._procs):
                self._fail("during start-up")
        return info

    def _fail(self, when: str) -> NoReturn:
        """Kill every worker and raise (for good) an EngineDeadError naming what failed first."""
        # A sentinel turns ready as the process exits, a moment before its exit code can be read.
        by_sentinel = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        gone = set(wait(list(by_sentinel), timeout=0))
        deadline = time.monotonic() + _SETTLE_SECONDS
        while gone and len(gone) < len(by_sentinel) and (left := deadline - time.monotonic()) > 0:
            more = wait([s for s in by_sentinel if s not in gone], timeout=left)
            if not more:
                break
            gone.update(more)
        exited = {by_sentinel[s]: self._procs[by_sentinel[s]] for s in gone}
        for proc in exited.values():
            proc.join(_STOP_SECONDS)
        for rank, conn in enumerate(self._conns):
            while not conn.closed and conn.poll(0) and self._read(rank) is not None:
                pass
        self._finalizer.detach()
        _stop(self._procs, self._conns, graceful=False)
        # Ranks that vanished without a word (killed, crashed) caused the rest; else the first Python exception.
        # Failures that followed (a peer's broken collective) get one line each.
        silent = [f"{_exit_text(rank, p)} {when}" for rank, p in sorted(exited.items()) if rank not in self._errors]
        raised = sorted(self._errors.items())
        if not silent and raised:
            rank, text = raised.pop(0)
            silent = [f"{_pid_text(rank, self._procs[rank])} raised {when}:\n{text.rstrip()}"]
        if not silent:
            silent = [f"processes stopped answering {when}"]
        lines = silent + [f"then {_pid_text(r, self._procs[r])} failed: {_last_line(t)}" for r, t in raised]
        self._dead = EngineDeadError("tensor-parallel worker " + "\n".join(lines))
        raise self._dead


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no message)"


def _pid_text(rank: int, proc) -> str:
    return f"rank {rank} (pid {proc.pid})"


def _exit_text(rank: int, proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        why = "; the kernel's out-of-memory killer sends it too" if name == "SIGKILL" else ""
        return f"{_pid_text(rank, proc)} died with exit code {code} ({name}{why})"
    return f"{_pid_text(rank, proc)} exited with exit code {code}"


def _stop(procs: list, conns: list[Connection], graceful: bool = True) -> None:
    """Stop every worker process and reap it (no zombies): SHUTDOWN through rank 0, then kill what is left."""
    if graceful and procs and all(p.exitcode is None for p in procs):
        try:
            conns[0].send_bytes(pickle.dumps(SHUTDOWN))
        except OSError:
            pass
        for p in procs:
            p.join(_STOP_SECONDS)
    for p in procs:
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join()
    for c in conns:
        c.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _send(conn: Connection, kind: str, value) -> None:
    conn.send_bytes(pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL))


def _worker_main(
    config: WorkerConfig, rank: int, world_size: int, init_method: str, snapshot: dict[str, str], conn: Connection
) -> None:
    """A worker process: build the rank, report ready, then serve steps until SHUTDOWN (or the engine is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        restore_registrations(snapshot)
        worker = Worker(config, rank, world_size, init_method)
        _send(conn, "ready", (worker.num_blocks, worker.dtype, worker.device))
        if rank == 0:
            _serve_engine(worker, conn)
        else:
            worker.follow()
    except BaseException:  # noqa: BLE001  (whatever it was, the engine gets its traceback rather than a silence)
        try:
            _send(conn, "error", traceback.format_exc())
        finally:
            os._exit(1)  # a broken group's teardown could block; the traceback is already sent
    destroy_tensor_parallel()


def _serve_engine(worker: Worker, conn: Connection) -> None:
    """Rank 0: each step from the engine goes to the other ranks (still pickled), runs here, and is answered."""
    while True:
        if not conn.poll(KEEPALIVE_SECONDS):
            tp_broadcast_object(KEEPALIVE)
            continue
        try:
            payload = conn.recv_bytes()
        except EOFError:  # the engine process is gone: take the other ranks down with us
            payload = pickle.dumps(SHUTDOWN)
        tp_broadcast_object(payload)
        msg = pickle.loads(payload)
        if msg == SHUTDOWN:
            return
        _send(conn, "ok", worker.execute_message(msg))
