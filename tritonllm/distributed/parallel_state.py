"""This process's place in the tensor-parallel group.

One process per rank. Layers read the group when they are built (how much of each weight this rank holds) and
when they run (their collectives). A process that never joins a group is rank 0 of 1, and every collective is
the identity, so single-GPU code paths carry no distributed cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(slots=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    device_group: dist.ProcessGroup | None = None  # activations: NCCL on GPUs, gloo on CPUs
    cpu_group: dist.ProcessGroup | None = None  # gloo, for Python objects (the steps rank 0 hands the others)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1


_GROUP = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _GROUP


def get_tp_rank() -> int:
    return _GROUP.rank


def get_tp_world_size() -> int:
    return _GROUP.world_size


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str = "env://",
    backend: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> TensorParallelGroup:
    """Join (or create) the default process group as `rank` of `world_size`, all ranks forming one tensor-parallel
    group. backend: "nccl" when CUDA is available, else "gloo" (the default). Idempotent for the same rank/size."""
    global _GROUP
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of size {world_size}")
    if _GROUP.world_size == world_size and _GROUP.rank == rank and (world_size == 1 or dist.is_initialized()):
        return _GROUP
    if world_size == 1:
        _GROUP = TensorParallelGroup()
        return _GROUP
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(
            f"torch.distributed is already initialized as rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"not rank {rank} of {world_size}; tensor_parallel_size must equal the launched world size"
        )
    device_group = dist.group.WORLD
    cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    _GROUP = TensorParallelGroup(rank, world_size, device_group, cpu_group)
    return _GROUP


def destroy_tensor_parallel() -> None:
    global _GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TensorParallelGroup()
