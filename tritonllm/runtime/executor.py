"""Where the workers run: the engine talks to one `Executor`, whatever the tensor-parallel size.

    UniprocExecutor         tensor_parallel_size 1: the worker in the engine process, called directly
    MultiprocExecutor       size W > 1 on one host: W spawned worker processes (multiproc_executor.py)
    TorchrunDriverExecutor  a torchrun launch: rank 0 runs the engine and its worker, the other launched
                            processes follow rank 0's broadcasts (torchrun_executor.py)

The scheduler runs once, in the engine process; executors carry its SchedulerOutput to every rank and bring
rank 0's StepResult back. An executor that loses a worker raises EngineDeadError (and keeps raising it).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

from tritonllm.platform import default_device
from tritonllm.runtime.scheduler_output import SchedulerOutput
from tritonllm.runtime.worker import PendingStep, StepResult, Worker, WorkerConfig


class Executor(ABC):
    num_blocks: int  # KV blocks per rank (the minimum over ranks), the scheduler's pool
    dtype: torch.dtype  # the model's dtype
    device: torch.device  # rank 0's device
    driver_worker: Worker | None = None  # the rank-0 worker when it lives in this process
    # Whether launch_step returns before the device finishes and runs continuations (asynchronous scheduling).
    supports_continuation: bool = False

    @abstractmethod
    def execute_step(self, out: SchedulerOutput, prompt_logit_seq_ids: set[int]) -> StepResult:
        """Run one non-empty step on every rank; rank 0's sampled tokens and logprobs."""

    def launch_step(
        self, out: SchedulerOutput, prompt_logit_seq_ids: set[int], previous: PendingStep | None = None
    ) -> PendingStep | StepResult:
        """Queue one step; its `result()` waits for it. Executors without continuations run it to the end."""
        if out.is_continuation:
            raise ValueError(f"{type(self).__name__} does not run continuation steps; schedule with schedule()")
        return self.execute_step(out, prompt_logit_seq_ids)

    def discard(self, seq_ids: Iterable[int]) -> None:  # noqa: B027  (nothing to forget in one process)
        """Sequences that ended or were preempted in a step that ran nothing: workers may forget them."""

    def check_health(self) -> None:  # noqa: B027  (an in-process worker cannot vanish)
        """Raise EngineDeadError if a worker is gone. Cheap, never blocks."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free what they hold; idempotent."""


class UniprocExecutor(Executor):
    """One rank, in this process: each step is a plain call, nothing is pickled."""

    def __init__(self, config: WorkerConfig) -> None:
        self.driver_worker = Worker(config)
        self.num_blocks = self.driver_worker.num_blocks
        self.dtype = self.driver_worker.dtype
        self.device = self.driver_worker.device

    supports_continuation = True

    def execute_step(self, out: SchedulerOutput, prompt_logit_seq_ids: set[int]) -> StepResult:
        return self.driver_worker.execute_step(out, prompt_logit_seq_ids)

    def launch_step(
        self, out: SchedulerOutput, prompt_logit_seq_ids: set[int], previous: PendingStep | None = None
    ) -> PendingStep:
        return self.driver_worker.launch_step(out, prompt_logit_seq_ids, previous)

    def shutdown(self) -> None:
        pass


def torchrun_world_size() -> int:
    """WORLD_SIZE of a torchrun (or other env://) launch of this process; 1 when not launched that way."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 1
    return int(os.environ["WORLD_SIZE"])


def check_parallel_config(tp: int, device: str | None) -> None:
    """Refuse a tensor-parallel size this launch cannot run, before any worker starts."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    launched = torchrun_world_size()
    if launched > 1 and tp != launched:
        raise ValueError(
            f"this process was launched by torchrun with WORLD_SIZE={launched}, but tensor_parallel_size={tp}; "
            f"pass --tensor-parallel-size {launched} (every launched process is one rank)"
        )
    if tp == 1:
        return
    target = torch.device(device) if device else default_device()
    if target.type == "cuda":
        if target.index is not None:
            raise ValueError(
                f"device={device!r} names one GPU, but tensor_parallel_size={tp} puts rank r on cuda:r; "
                "pass device='cuda' and choose the GPUs with CUDA_VISIBLE_DEVICES"
            )
        local = int(os.environ.get("LOCAL_WORLD_SIZE", tp)) if launched > 1 else tp
        visible = torch.cuda.device_count()
        if local > visible:
            raise ValueError(
                f"tensor_parallel_size={tp} needs {local} GPUs on this host but {visible} are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                "lower --tensor-parallel-size or make more GPUs visible"
            )
    elif target.type != "cpu":
        raise ValueError(f"tensor parallelism runs on cuda or cpu devices, got {target}")


def create_executor(config: WorkerConfig) -> Executor:
    """The executor for config.engine.tensor_parallel_size. In a torchrun launch, ranks other than 0 never return
    from here: they run rank 0's steps until it shuts down, then exit the process (SystemExit(0))."""
    tp = config.engine.tensor_parallel_size
    check_parallel_config(tp, config.engine.device)
    if torchrun_world_size() > 1:
        from tritonllm.runtime.torchrun_executor import TorchrunDriverExecutor, run_torchrun_follower

        if int(os.environ["RANK"]) != 0:
            run_torchrun_follower(config)
            raise SystemExit(0)
        return TorchrunDriverExecutor(config)
    if tp == 1:
        return UniprocExecutor(config)
    from tritonllm.runtime.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config)
