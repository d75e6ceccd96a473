"""Collectives over the tensor-parallel group; each is the identity for a group of one."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tritonllm.distributed.parallel_state import get_tp_group

# torch >= 2.13 renames all_gather_into_tensor (and warns on the old name); older releases have only that one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place (in x's dtype, as the row-parallel layers' partial sums are); returns x."""
    group = get_tp_group()
    if group.is_parallel:
        dist.all_reduce(x, group=group.device_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, rank 0 first (all ranks' x have one shape)."""
    group = get_tp_group()
    if not group.is_parallel:
        return x
    dim = dim % x.dim()
    x = x.contiguous()
    out = torch.empty((group.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group.device_group)
    if dim == 0:
        return out
    # [world * d0, ...] -> [world, d0, ...] -> rank blocks side by side along dim.
    return torch.cat(out.chunk(group.world_size, dim=0), dim=dim)


def tp_broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Rank `src`'s Python object on every rank (pickled over the gloo group)."""
    group = get_tp_group()
    if not group.is_parallel:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group.cpu_group)
    return box[0]
