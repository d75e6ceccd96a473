"""Run test functions on W spawned CPU processes joined in one tensor-parallel group (gloo, Triton interpreter).

    with TPWorkers(world_size=2) as workers:
        outputs = workers.run(fn, *args)  # [rank 0's return value, rank 1's, ...]
        workers.submit(fn, *args); reference = ...; outputs = workers.wait()  # overlap with the parent's work

`fn` must be importable by the children (a module-level function). The processes stay up between calls, so a test
module pays the spawn once; a rank's exception is raised in the parent with the rank's traceback, and a call that
does not finish within `timeout` seconds (a hang in a collective) fails instead of blocking.
"""

from __future__ import annotations

import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

# How long a rank's collective waits for the others before failing (a rank that raised never arrives).
COLLECTIVE_TIMEOUT_S = 60.0


class RankError(AssertionError):
    """A function raised on one of the ranks; the message holds that rank's traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, init_method: str, tasks, results) -> None:
    import torch

    import tritonllm  # noqa: F401  (sets TRITON_INTERPRET before any kernel module loads)
    from tritonllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)  # W ranks share the machine's cores
    try:
        init_tensor_parallel(
            rank, world_size, init_method, backend="gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        )
    except BaseException:
        results.put((0, rank, False, traceback.format_exc()))
        return
    results.put((0, rank, True, "ready"))
    while (job := tasks.get()) is not None:
        job_id, fn, args, kwargs = job
        try:
            results.put((job_id, rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((job_id, rank, False, traceback.format_exc()))
    destroy_tensor_parallel()


class TPWorkers:
    def __init__(self, world_size: int = 2, timeout: float = 180.0):
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list = []
        self._job = 0  # results of an abandoned job (its caller raised before `wait`) are told apart and dropped
        self._pending = ""

    def __enter__(self) -> TPWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._job = 0
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, init_method, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("joining the group")

    def run(self, fn, *args: Any, **kwargs: Any) -> list[Any]:
        """fn(*args, **kwargs) on every rank at once; their return values in rank order."""
        self.submit(fn, *args, **kwargs)
        return self.wait()

    def submit(self, fn, *args: Any, **kwargs: Any) -> None:
        """Start fn on every rank and return at once (the parent can compute a reference meanwhile); `wait` for it."""
        if not self._procs:
            self._start()
        self._job += 1
        for q in self._tasks:
            q.put((self._job, fn, args, kwargs))
        self._pending = getattr(fn, "__name__", repr(fn))

    def wait(self) -> list[Any]:
        """The return values, in rank order, of the function last submitted."""
        return self._collect(self._pending)

    def _collect(self, what: str) -> list[Any]:
        limit = time.monotonic() + self.timeout
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        while len(values) + len(failures) < self.world_size:
            try:
                job, rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if p.exitcode is not None and r not in failures and r not in values:
                        failures[r] = f"process exited with code {p.exitcode}"
                        limit = min(limit, time.monotonic() + 5.0)
                if time.monotonic() > limit:
                    break
                continue
            if job != self._job:
                continue
            if ok:
                values[rank] = value
            else:
                failures.setdefault(rank, value)
                # The other ranks get a short grace: they may be waiting in a collective the failed rank never joins.
                limit = min(limit, time.monotonic() + 5.0)
        if failures or len(values) < self.world_size:
            if len(values) + len(failures) < self.world_size or any(not p.is_alive() for p in self._procs):
                self.close(kill=True)  # a rank is stuck (in a collective the others left) or gone: start afresh
            if failures:
                rank = min(failures)
                raise RankError(f"{what} failed on rank {rank} of {self.world_size}:\n{failures[rank]}")
            raise TimeoutError(f"{what} did not finish on every rank within {self.timeout:.0f} s")
        return [values[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        """Stop the processes (a later run starts fresh ones); `kill` does not wait for a busy rank."""
        if not self._procs:
            return
        for p, q in zip(self._procs, self._tasks, strict=True):
            if p.is_alive() and not kill:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []


def run_tp(fn, *args: Any, world_size: int = 2, timeout: float = 180.0, **kwargs: Any) -> list[Any]:
    """fn(*args, **kwargs) once on `world_size` fresh ranks; their return values in rank order."""
    with TPWorkers(world_size, timeout) as workers:
        return workers.run(fn, *args, **kwargs)
