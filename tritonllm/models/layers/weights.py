"""Weight loaders shared by layers whose parameters load from one checkpoint tensor as they are."""

from __future__ import annotations

import torch


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_index: int | None = None) -> None:
    """Copy a whole checkpoint tensor into `param` (casting to its dtype); shapes must match exactly."""
    if shard_index is not None:
        raise ValueError(f"this parameter is not fused from shards, got shard index {shard_index}")
    if tuple(loaded_weight.shape) != tuple(param.shape):
        raise ValueError(f"expected shape {list(param.shape)}, found {list(loaded_weight.shape)}")
    with torch.no_grad():
        param.data.copy_(loaded_weight)
