"""Tensor parallelism under torchrun (one process per rank, on one or several hosts).

torchrun starts every process with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; each joins the
group through env://. Rank 0 runs the engine, the scheduler and its own worker in-process (the driver) and
broadcasts each step to the others; ranks > 0 run `Worker.follow` and exit when rank 0 shuts down.

Failure detection relies on the collectives: a rank whose peer process died gets an error from its next gloo
collective as soon as the peer's sockets close; a host that vanishes (or a rank hung in an NCCL collective) is
only noticed when the collective times out (10 minutes, `parallel_state.DEFAULT_TIMEOUT`). torchrun's own agent
also stops every local rank when one of them exits with an error.
"""

from __future__ import annotations

import atexit
import os
import pickle
import threading
import time

from tritonllm.distributed.communication import tp_broadcast_object
from tritonllm.distributed.parallel_state import destroy_tensor_parallel
from tritonllm.runtime.errors import EngineDeadError
from tritonllm.runtime.executor import Executor
from tritonllm.runtime.multiproc_executor import KEEPALIVE_SECONDS
from tritonllm.runtime.scheduler_output import SchedulerOutput
from tritonllm.runtime.step_messages import KEEPALIVE, SHUTDOWN, StepEncoder
from tritonllm.runtime.worker import StepResult, Worker, WorkerConfig


def _launch() -> tuple[int, int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def run_torchrun_follower(config: WorkerConfig) -> None:
    """Ranks > 0 of a torchrun launch: build the rank, run rank 0's steps until it shuts down."""
    rank, world_size, local_rank = _launch()
    worker = Worker(config, rank, world_size, "env://", local_rank)
    worker.follow()
    destroy_tensor_parallel()


class TorchrunDriverExecutor(Executor):
    """Rank 0 of a torchrun launch: its worker runs here on the scheduler's own SchedulerOutput; the other ranks
    get each step as a StepMessage broadcast over the gloo group."""

    def __init__(self, config: WorkerConfig) -> None:
        rank, world_size, local_rank = _launch()
        self.driver_worker = Worker(config, rank, world_size, "env://", local_rank)
        self.num_blocks = self.driver_worker.num_blocks
        self.dtype = self.driver_worker.dtype
        self.device = self.driver_worker.device
        self._encoder = StepEncoder()
        self._dead: EngineDeadError | None = None
        # Steps and keepalives share the group: one at a time, in one order on every rank.
        self._lock = threading.Lock()
        self._last_broadcast = time.monotonic()
        self._stopping = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, name="tritonllm-tp-keepalive", daemon=True)
        self._keepalive.start()
        atexit.register(self.shutdown)

    def execute_step(self, out: SchedulerOutput, prompt_logit_seq_ids: set[int]) -> StepResult:
        if self._dead is not None:
            raise self._dead
        payload = pickle.dumps(self._encoder.encode(out, prompt_logit_seq_ids), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            try:
                tp_broadcast_object(payload)
                self._last_broadcast = time.monotonic()
                return self.driver_worker.execute_step(out, prompt_logit_seq_ids)
            except Exception as e:
                # A failed collective leaves the ranks out of step: nothing more can run.
                self._dead = EngineDeadError(f"tensor-parallel rank 0 failed in a step: {type(e).__name__}: {e}")
                raise self._dead from e

    def discard(self, seq_ids) -> None:
        self._encoder.discard(seq_ids)

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead

    def shutdown(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        atexit.unregister(self.shutdown)
        with self._lock:
            if self._dead is None:
                try:
                    tp_broadcast_object(SHUTDOWN)
                except Exception:  # noqa: BLE001  (peers already gone: nothing left to stop)
                    pass
                self._dead = EngineDeadError("the engine is shut down")
            destroy_tensor_parallel()

    def _keep_alive(self) -> None:
        while not self._stopping.wait(KEEPALIVE_SECONDS / 4):
            if time.monotonic() - self._last_broadcast < KEEPALIVE_SECONDS or not self._lock.acquire(blocking=False):
                continue
            try:
                if self._dead is None and not self._stopping.is_set():
                    tp_broadcast_object(KEEPALIVE)
                    self._last_broadcast = time.monotonic()
            except Exception as e:  # noqa: BLE001  (reported to the next step and to health checks)
                self._dead = EngineDeadError(f"tensor-parallel rank 0 lost its peers: {type(e).__name__}: {e}")
            finally:
                self._lock.release()
