"""Where one rank's slice of a linear layer sits in the full layer, and how a checkpoint tensor is cut to it.

Every parameter a LinearMethod creates declares (`tritonllm.quant.base.set_shard_axes`) which dim of its checkpoint
tensor runs along the logical outputs N and inputs K, and the ratio of that dim's length to the logical one. The
slicing below is therefore written once for every format: the layer checks the checkpoint tensor against the full
layer's shape, narrows it to the rank's columns (each fused output separately) and rows, and hands the slice to the
parameter's own weight_loader, which places it as it would place an unsharded tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import nn


@dataclass(slots=True)
class LinearPartition:
    """This rank's share of a linear layer x [.., K] -> [.., sum(N_i)] fused from outputs N_i.

    Output i: columns [output_starts[i], output_starts[i] + output_sizes[i]) of that output's full_output_sizes[i].
    Input: features [input_start, input_start + input_size) of full_input_size.
    """

    rank: int
    world_size: int
    full_input_size: int
    full_output_sizes: list[int]
    input_start: int
    input_size: int
    output_starts: list[int]
    output_sizes: list[int]

    @classmethod
    def replicated(cls, input_size: int, output_sizes: list[int], rank: int = 0, world_size: int = 1):
        """Every rank holds the whole layer."""
        return cls(
            rank, world_size, input_size, list(output_sizes), 0, input_size, [0] * len(output_sizes), list(output_sizes)
        )

    @property
    def input_split(self) -> bool:
        return self.input_size != self.full_input_size

    @property
    def output_split(self) -> bool:
        return self.output_sizes != self.full_output_sizes

    @property
    def is_sharded(self) -> bool:
        return self.input_split or self.output_split


def _scaled(size: int, ratio: Fraction, what: str) -> int:
    value = size * ratio
    if value.denominator != 1:
        raise ValueError(f"{what}: {size} * {ratio} is not a whole number of elements")
    return int(value)


def rank_slice(
    param: torch.Tensor, loaded: torch.Tensor, shard_index: int | None, part: LinearPartition, name: str
) -> torch.Tensor:
    """The part of checkpoint tensor `loaded` (output `shard_index` of the fused layer, or all outputs when None)
    that this rank's `param` holds. Raises ValueError with the full (checkpoint) shape on a mismatch."""
    n = len(part.full_output_sizes)
    if shard_index is not None and not 0 <= shard_index < n:
        raise ValueError(f"shard index {shard_index} out of range for a layer fused from {n} outputs")
    shards = range(n) if shard_index is None else [shard_index]
    out_dim, in_dim = param.output_dim, param.input_dim
    # Parameters stored as the checkpoint lays them out give the whole expected shape; others (GPTQ's g_idx keeps a
    # row per fused output) give only the dims along the layer's axes, the rest left to the parameter's loader.
    expected = list(param.shape) if loaded.dim() == param.dim() else list(loaded.shape)
    if out_dim is not None:
        expected[out_dim] = sum(_scaled(part.full_output_sizes[i], param.output_ratio, name) for i in shards)
    if in_dim is not None and part.input_split:
        expected[in_dim] = _scaled(part.full_input_size, param.input_ratio, name)
    if list(loaded.shape) != expected:
        raise ValueError(f"expected shape {expected}, found {list(loaded.shape)}")

    if out_dim is not None and part.output_split:
        pieces, offset = [], 0
        for i in shards:
            start = offset + _scaled(part.output_starts[i], param.output_ratio, name)
            pieces.append(loaded.narrow(out_dim, start, _scaled(part.output_sizes[i], param.output_ratio, name)))
            offset += _scaled(part.full_output_sizes[i], param.output_ratio, name)
        loaded = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=out_dim)
    if in_dim is not None and part.input_split:
        start = _scaled(part.input_start, param.input_ratio, name)
        loaded = loaded.narrow(in_dim, start, _scaled(part.input_size, param.input_ratio, name))
    return loaded


def shard_loaders(layer: nn.Module, part: LinearPartition) -> None:
    """Wrap the weight_loader of each of `layer`'s own parameters so it receives this rank's slice.

    A parameter split along an axis is marked `tp_sharded` (its values differ between ranks)."""
    prefix = getattr(layer, "prefix", "") or type(layer).__name__
    for name, param in layer.named_parameters(recurse=False):
        if not (hasattr(param, "output_dim") and hasattr(param, "input_dim")):
            method = type(getattr(layer, "linear_method", None)).__name__
            raise ValueError(
                f"{prefix}.{name}: {method}.create_weights declares no shard axes for it, so tensor parallelism "
                "cannot slice it; declare them with tritonllm.quant.base.set_shard_axes"
            )
        inner: Callable = param.weight_loader

        def weight_loader(p, loaded, shard_index=None, _inner=inner, _name=f"{prefix}.{name}"):
            _inner(p, rank_slice(p, loaded, shard_index, part, _name), shard_index)

        param.weight_loader = weight_loader
        split_out = param.output_dim is not None and part.output_split
        split_in = param.input_dim is not None and part.input_split
        param.tp_sharded = split_out or split_in
