"""Pieces AWQ and GPTQ share: settings fields with clear errors, skipped-module rules, column-sharded loaders."""

from __future__ import annotations

from typing import Any

import torch

from tritonllm.quant.base import LinearMethod

# Fused layers and the checkpoint projections they are built from (the models' packed_modules_mapping).
DEFAULT_PACKED_MODULES: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}

_MISSING = object()


def field(qc: dict[str, Any], source: str, names: tuple[str, ...], default: Any = _MISSING) -> Any:
    """The first of `names` present in the settings (aliases: AutoAWQ's w_bit for bits, ...)."""
    for name in names:
        if name in qc and qc[name] is not None:
            return qc[name]
    if default is _MISSING:
        raise ValueError(f"{source} has no {names[0]!r}; it is required")
    return default


def int_field(qc: dict[str, Any], source: str, names: tuple[str, ...], default: Any = _MISSING) -> int:
    value = field(qc, source, names, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}.{names[0]}={value!r} must be an integer")
    return value


def bool_field(qc: dict[str, Any], source: str, names: tuple[str, ...], default: bool) -> bool:
    value = field(qc, source, names, default)
    if not isinstance(value, bool):
        raise ValueError(f"{source}.{names[0]}={value!r} must be true or false")
    return value


def check_group_size(group_size: int, source: str) -> None:
    if group_size != -1 and group_size <= 0:
        raise ValueError(
            f"{source}.group_size={group_size} is not supported; supported: -1 (one group) or a positive size "
            "(32, 64, 128, ...)"
        )


def module_names(qc: dict[str, Any], source: str, key: str) -> list[str]:
    """A list-of-names setting (modules_to_not_convert; nested lists are flattened)."""
    value = qc.get(key) or []
    if isinstance(value, str):
        value = [value]
    names: list[str] = []
    for item in value:
        if isinstance(item, (list, tuple)):
            names.extend(str(x) for x in item)
        else:
            names.append(str(item))
    return names


def shard_names(prefix: str, packed: dict[str, list[str]]) -> list[str]:
    """The checkpoint module names a layer is built from: "...qkv_proj" -> ["...q_proj", "...k_proj", "...v_proj"]."""
    head, _, last = prefix.rpartition(".")
    if last in packed:
        return [f"{head}.{name}" if head else name for name in packed[last]]
    return [prefix]


def output_names(prefix: str, count: int) -> list[str]:
    """Short names of a layer's `count` logical outputs for messages: ["gate_proj", "up_proj"] for
    "...mlp.gate_up_proj", ["down_proj"] for "...mlp.down_proj", else "output i"."""
    names = shard_names(prefix, DEFAULT_PACKED_MODULES) if prefix else []
    if len(names) != count:
        return [f"output {i}" for i in range(count)]
    return [name.rpartition(".")[2] for name in names]


def is_skipped(prefix: str, skip: list[str], packed: dict[str, list[str]]) -> bool:
    """Whether the checkpoint left this layer unquantized: lm_head always, else any name in `skip` occurring in
    the module name (AutoAWQ's and transformers' rule). A fused layer must be all skipped or all quantized."""
    if prefix == "lm_head" or prefix.endswith(".lm_head"):
        return True
    names = shard_names(prefix, packed)
    skipped = [any(s and s in name for s in skip) for name in names]
    if any(skipped) and not all(skipped):
        raise ValueError(
            f"{prefix} is fused from {', '.join(names)}, but modules_to_not_convert leaves only some of them "
            "unquantized; a fused layer needs one format for all its parts"
        )
    return all(skipped)


def unquantized_method() -> LinearMethod:
    from tritonllm.models.layers.linear import UnquantizedLinearMethod  # late: models import this package

    return UnquantizedLinearMethod()


def make_column_loader(widths: list[int], name: str, dtype: torch.dtype | None = None):
    """A weight_loader for a parameter whose dim 1 is the fused output, `widths[i]` columns for shard i.

    `dtype`, when given, is the only dtype accepted from the checkpoint (packed int32 words must not be cast).
    """

    def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_index: int | None = None) -> None:
        if shard_index is None:
            start, size = 0, sum(widths)
        elif 0 <= shard_index < len(widths):
            start, size = sum(widths[:shard_index]), widths[shard_index]
        else:
            raise ValueError(f"shard index {shard_index} out of range for a layer fused from {len(widths)} outputs")
        if dtype is not None and loaded_weight.dtype != dtype:
            raise ValueError(f"{name} must be stored as {dtype}, found {loaded_weight.dtype}")
        expected = (param.shape[0], size)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"expected {name} shape {list(expected)}, found {list(loaded_weight.shape)}")
        with torch.no_grad():
            param.data[:, start : start + size].copy_(loaded_weight)

    return weight_loader


def int_parameter(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(*shape, dtype=torch.int32), requires_grad=False)


def _tp_size(layer: torch.nn.Module) -> int:
    return getattr(layer, "tp_size", 1)


def input_share_error(layer: torch.nn.Module, input_size: int, unit: int, what: str) -> str | None:
    """None when a rank's share of the input fills whole `unit`s; else the message for a row-parallel layer
    that splits `what` (e.g. "AWQ group_size 32", "4-bit GPTQ packs K in runs of 8") mid-unit."""
    if input_size % unit == 0 or not (getattr(layer, "input_is_parallel", False) and _tp_size(layer) > 1):
        return None
    where = getattr(layer, "prefix", "") or "a linear layer"
    full, tp = getattr(layer, "full_input_size", input_size), _tp_size(layer)
    return (
        f"{where}: {what}: the rank's share {input_size} of its {full} input features is not a multiple of {unit} "
        f"(tensor_parallel_size={tp}); a row-parallel layer needs whole quant groups and packed words per rank: "
        f"choose a tensor_parallel_size that divides {full} into multiples of {unit}"
    )


def output_share_error(layer: torch.nn.Module, output_sizes: list[int], unit: int, what: str) -> str | None:
    """None when every per-rank output size is a multiple of `unit`; else, on a column-parallel layer, the message
    naming each output whose rank's share is not (e.g. "the rank's share 12 of gate_proj's 24 columns")."""
    bad = [i for i, n in enumerate(output_sizes) if n % unit]
    full = getattr(layer, "full_output_sizes", output_sizes)
    if not bad or _tp_size(layer) == 1 or list(full) == list(output_sizes):
        return None
    where = getattr(layer, "prefix", "") or "a linear layer"
    names = output_names(getattr(layer, "prefix", ""), len(output_sizes))
    shares = ", ".join(f"the rank's share {output_sizes[i]} of {names[i]}'s {full[i]} columns" for i in bad)
    verb = "is" if len(bad) == 1 else "are each"
    return (
        f"{where}: {what}: {shares} {verb} not a multiple of {unit} (tensor_parallel_size={_tp_size(layer)}); "
        f"choose a tensor_parallel_size that leaves each rank a multiple of {unit} columns"
    )
