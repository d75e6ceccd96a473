"""GPTQ (AutoGPTQ / GPTQModel, checkpoint_format gptq or gptq_v2): settings and the linear method.

Checkpoint layout, loaded as is (shards concatenated along N; every tensor is packed or laid along N by columns,
qzeros in words of 32 // bits columns):
    qweight [K * bits // 32, N] int32 · qzeros [G, N * bits // 32] int32 · scales [G, N] fp16 · g_idx [K] int32

After loading, each layer picks how it runs:
  * "fused": bits 2 / 4 / 8 and g_idx either regular (k // g) or a permutation of regular groups (act-order /
    desc_act). For act-order the packed rows are permuted once, here, so that groups become runs of g rows, and
    the GEMM multiplies x[:, perm] (one gather of x's columns per call, then the plain kernels).
  * "dequant": 3-bit, or g_idx that is not a permutation of regular groups, or fused shards whose g_idx differ, or
    a row-parallel act-order shard (it keeps every group's scales, its g_idx global group ids): the dequantization
    kernel (which follows g_idx itself) builds the dense weight per call, then a matmul.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

import torch
from torch import nn

from tritonllm.kernels.quant_dequant import gptq_dequantize
from tritonllm.kernels.quant_gemm import FUSED_GPTQ_BITS, gptq_gemm
from tritonllm.quant.base import LinearMethod, QuantConfig, set_shard_axes
from tritonllm.quant.common import (
    DEFAULT_PACKED_MODULES,
    bool_field,
    check_group_size,
    input_share_error,
    int_field,
    int_parameter,
    is_skipped,
    make_column_loader,
    module_names,
    output_share_error,
    unquantized_method,
)
from tritonllm.quant.common import (
    field as setting,
)
from tritonllm.quant.pack import GPTQ_BITS, GPTQ_CHECKPOINT_FORMATS, pack_bits, regular_g_idx, unpack_bits


@dataclass(slots=True)
class GptqConfig(QuantConfig):
    name: ClassVar[str] = "gptq"

    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    sym: bool = True
    static_groups: bool = False
    checkpoint_format: str = "gptq"
    modules_to_not_convert: list[str] = field(default_factory=list)
    packed_modules: dict[str, list[str]] = field(default_factory=lambda: dict(DEFAULT_PACKED_MODULES))

    @classmethod
    def from_dict(cls, qc: dict[str, Any], source: str = "quantization_config") -> GptqConfig:
        """Parse AutoGPTQ / GPTQModel / transformers GPTQ settings, refusing what we cannot run."""
        bits = int_field(qc, source, ("bits",))
        if bits not in GPTQ_BITS:
            supported = ", ".join(map(str, GPTQ_BITS))
            raise ValueError(f"{source}.bits={bits} is not supported for GPTQ; supported: {supported}")
        group_size = int_field(qc, source, ("group_size",), 128)
        check_group_size(group_size, source)
        fmt = str(setting(qc, source, ("checkpoint_format", "format"), "gptq")).lower()
        if fmt not in GPTQ_CHECKPOINT_FORMATS:
            raise ValueError(
                f"{source}.checkpoint_format={fmt!r} is not supported; supported: "
                f"{', '.join(map(repr, GPTQ_CHECKPOINT_FORMATS))}"
            )
        if bool_field(qc, source, ("is_marlin_format",), False):
            raise ValueError(f"{source}.is_marlin_format=true (Marlin-repacked) is not supported; supported: false")
        pack_dtype = str(qc.get("pack_dtype") or "int32").removeprefix("torch.")
        if pack_dtype != "int32":
            raise ValueError(f"{source}.pack_dtype={pack_dtype!r} is not supported; supported: 'int32'")
        if bool_field(qc, source, ("lm_head",), False):
            raise ValueError(
                f"{source}.lm_head=true (a quantized lm_head) is not supported; supported: false (tritonllm keeps "
                "lm_head unquantized)"
            )
        if qc.get("dynamic"):
            raise ValueError(
                f"{source}.dynamic (per-module overrides) is not supported; supported: absent or empty "
                "(one bits/group_size for every layer)"
            )
        if qc.get("modules_in_block_to_quantize"):
            raise ValueError(
                f"{source}.modules_in_block_to_quantize is not supported; supported: absent (every linear layer of "
                "each block quantized), with modules_to_not_convert naming the exceptions"
            )
        return cls(
            bits=bits,
            group_size=group_size,
            desc_act=bool_field(qc, source, ("desc_act",), False),
            sym=bool_field(qc, source, ("sym",), True),
            static_groups=bool_field(qc, source, ("static_groups",), False),
            checkpoint_format=fmt,
            modules_to_not_convert=module_names(qc, source, "modules_to_not_convert"),
        )

    @property
    def zero_offset(self) -> int:
        """v1 ("gptq") stores zero - 1; readers add 1 back."""
        return 1 if self.checkpoint_format == "gptq" else 0

    def get_linear_method(self, prefix: str) -> LinearMethod:
        if is_skipped(prefix, self.modules_to_not_convert, self.packed_modules):
            return unquantized_method()
        return GptqLinearMethod(self)


class GptqLinearMethod(LinearMethod):
    def __init__(self, config: GptqConfig):
        self.config = config

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        bits = self.config.bits
        where = getattr(layer, "prefix", "") or "a linear layer"
        # Whole words: 32 // bits values per word, or 32 values per 3 words for 3-bit.
        unit = 32 if bits == 3 else 32 // bits
        if input_size % unit:
            raise ValueError(
                input_share_error(layer, input_size, unit, f"{bits}-bit GPTQ packs K in runs of {unit}")
                or f"{where}: {bits}-bit GPTQ packs K in runs of {unit}; the input size {input_size} is not"
            )
        bad = [n for n in output_sizes if n % unit]
        if bad:
            raise ValueError(
                output_share_error(layer, output_sizes, unit, f"{bits}-bit GPTQ packs zeros in runs of {unit} columns")
                or f"{where}: {bits}-bit GPTQ packs zeros in runs of {unit} columns; output sizes {bad} aren't"
            )
        g = input_size if self.config.group_size == -1 else self.config.group_size
        groups = -(-input_size // g)
        # A row-parallel rank holds a K-slice and, normally, the whole groups inside it (g_idx rebased by
        # group_start). Act-order scatters each group over all of K, so there the rank keeps every group's
        # scales/zeros and g_idx keeps global ids: the dequantizing path, which follows g_idx, runs it. One group
        # (-1) is kept whole by every rank.
        split = getattr(layer, "input_is_parallel", False)
        replicated = split and (self.config.desc_act or self.config.group_size == -1)
        group_start = 0
        if replicated and self.config.group_size != -1:
            groups = -(-getattr(layer, "full_input_size", input_size) // g)
        elif split and not replicated:
            if input_size % g:
                raise ValueError(input_share_error(layer, input_size, g, f"GPTQ group_size {g}"))
            group_start = getattr(layer, "tp_rank", 0) * input_size // g
        groups_axis = None if replicated else (0, Fraction(1, g))
        n = sum(output_sizes)
        # fp16 scales as the tools write them; other float checkpoints are cast on load.
        scales = nn.Parameter(torch.zeros(groups, n, dtype=torch.float16), requires_grad=False)
        # name: (parameter, shard widths, required dtype, (dim, ratio) along N, (dim, ratio) along K)
        specs = {
            "qweight": (
                int_parameter(input_size * bits // 32, n),
                list(output_sizes),
                torch.int32,
                (1, 1),
                (0, Fraction(bits, 32)),
            ),
            "qzeros": (
                int_parameter(groups, n * bits // 32),
                [s * bits // 32 for s in output_sizes],
                torch.int32,
                (1, Fraction(bits, 32)),
                groups_axis,
            ),
            "scales": (scales, list(output_sizes), None, (1, 1), groups_axis),
        }
        for name, (param, widths, dtype, n_axis, k_axis) in specs.items():
            param.weight_loader = make_column_loader(widths, name, dtype)
            set_shard_axes(param, output=n_axis, input=k_axis)
            layer.register_parameter(name, param)

        # One g_idx row per shard: projections fused here were quantized separately and may order K differently.
        num_shards = len(output_sizes)
        g_idx = int_parameter(num_shards, input_size)
        g_idx.data.copy_(regular_g_idx(input_size, g).expand(num_shards, -1))
        g_idx.load_optional = True  # older checkpoints without act-order omit it
        set_shard_axes(g_idx, output=None, input=(0, 1))  # checkpoint g_idx [K]

        def load_g_idx(param: torch.Tensor, loaded_weight: torch.Tensor, shard_index: int | None = None) -> None:
            rows = range(num_shards) if shard_index is None else [shard_index]
            if shard_index is not None and not 0 <= shard_index < num_shards:
                raise ValueError(f"shard index {shard_index} out of range for a layer fused from {num_shards} outputs")
            if tuple(loaded_weight.shape) != (input_size,):
                raise ValueError(f"expected g_idx shape [{input_size}], found {list(loaded_weight.shape)}")
            if loaded_weight.is_floating_point():
                raise ValueError(f"g_idx must hold integers, found {loaded_weight.dtype}")
            first, end = group_start, group_start + groups
            if loaded_weight.numel() and (loaded_weight.min() < first or loaded_weight.max() >= end):
                if split and not replicated:
                    raise ValueError(
                        f"g_idx values of this rank's input features must lie in its groups [{first}, {end}) "
                        "(row-parallel without desc_act splits K by whole groups); set desc_act=true in the "
                        "quantization config if this checkpoint's groups are scattered over K"
                    )
                raise ValueError(f"g_idx values must lie in [0, {groups}) for {groups} groups")
            with torch.no_grad():
                for r in rows:
                    param.data[r].copy_(loaded_weight - group_start)

        g_idx.weight_loader = load_g_idx
        layer.register_parameter("g_idx", g_idx)
        layer.register_buffer("gptq_perm", None, persistent=False)  # act-order: input feature of each packed row
        layer.gptq_group_size = g
        layer.gptq_output_sizes = list(output_sizes)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        bits, g = self.config.bits, layer.gptq_group_size
        g_idx = layer.g_idx.data  # [num_shards, K]
        k = g_idx.shape[1]
        regular = regular_g_idx(k, g, device=g_idx.device)
        same = bool((g_idx == g_idx[:1]).all())
        # A row-parallel act-order shard keeps every group's scales (more rows than its K-slice's groups): dequant.
        own_groups = layer.scales.shape[0] == -(-k // g)
        layer.gptq_perm = None
        layer.gptq_segments = None
        if same and own_groups and bits in FUSED_GPTQ_BITS:
            first = g_idx[0]
            if torch.equal(first, regular):
                layer.gptq_mode = "fused"
                return
            perm = torch.argsort(first, stable=True)
            if torch.equal(first[perm], regular):
                # Act-order: permute packed rows once so row i (input feature perm[i]) sits in group i // g.
                ints = unpack_bits(layer.qweight.data, bits, dim=0)
                layer.qweight.data.copy_(pack_bits(ints[perm], bits, dim=0))
                layer.gptq_perm = perm.to(torch.int32).contiguous()
                layer.gptq_mode = "fused"
                return
        # Dequantize per call; contiguous shards with equal g_idx share one segment.
        segments, start = [], 0
        for i, size in enumerate(layer.gptq_output_sizes):
            if segments and torch.equal(g_idx[i], segments[-1][2]):
                segments[-1] = (segments[-1][0], start + size, segments[-1][2])
            else:
                segments.append((start, start + size, g_idx[i].clone()))
            start += size
        layer.gptq_segments = segments
        layer.gptq_mode = "dequant"

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """Dense W^T [K, N] in `dtype` from the loaded checkpoint tensors (dequant mode)."""
        bits = self.config.bits
        parts = []
        for start, end, g_idx in layer.gptq_segments:
            z0, z1 = start * bits // 32, end * bits // 32
            parts.append(
                gptq_dequantize(
                    layer.qweight[:, start:end],
                    layer.qzeros[:, z0:z1],
                    layer.scales[:, start:end],
                    g_idx,
                    bits,
                    layer.gptq_group_size,
                    self.config.zero_offset,
                    dtype=dtype,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        mode = getattr(layer, "gptq_mode", None)
        if mode is None:
            raise RuntimeError("GPTQ layer used before process_weights_after_loading")
        if mode == "fused":
            return gptq_gemm(
                x,
                layer.qweight,
                layer.qzeros,
                layer.scales,
                self.config.bits,
                layer.gptq_group_size,
                self.config.zero_offset,
                layer.gptq_perm,
                bias,
            )
        y = x @ self.dequantize(layer, x.dtype)
        return y if bias is None else y + bias
