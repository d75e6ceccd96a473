"""AWQ (AutoAWQ `version: gemm`, 4-bit, zero point): settings and the linear method over the fused W4A16 GEMM.

Checkpoint shards load as they are stored:
    qweight [K, N // 8] int32 · qzeros [K // g, N // 8] int32 · scales [K // g, N] fp16
Fused layers concatenate shards along N; every tensor is packed along N in whole words of 8 columns, so shard i
fills columns (or words) starting where shard i - 1 ended. After loading, qweight and qzeros are repacked once,
on the device, into GPTQ's layout (qweight [K // 8, N] packed along K, zeros in column order, no +1 offset), so
AWQ runs through the same fused kernel as GPTQ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

import torch
from torch import nn

from tritonllm.kernels.quant_gemm import gptq_gemm
from tritonllm.quant.base import LinearMethod, QuantConfig, set_shard_axes
from tritonllm.quant.common import (
    DEFAULT_PACKED_MODULES,
    bool_field,
    check_group_size,
    input_share_error,
    int_field,
    is_skipped,
    make_column_loader,
    module_names,
    output_share_error,
    unquantized_method,
)
from tritonllm.quant.common import (
    field as setting,
)
from tritonllm.quant.pack import repack_awq_as_gptq

AWQ_VERSIONS = ("gemm",)


@dataclass(slots=True)
class AwqConfig(QuantConfig):
    name: ClassVar[str] = "awq"

    group_size: int = 128
    bits: int = 4
    modules_to_not_convert: list[str] = field(default_factory=list)
    packed_modules: dict[str, list[str]] = field(default_factory=lambda: dict(DEFAULT_PACKED_MODULES))

    @classmethod
    def from_dict(cls, qc: dict[str, Any], source: str = "quantization_config") -> AwqConfig:
        """Parse AutoAWQ / transformers AWQ settings, refusing what the GEMM path cannot run."""
        bits = int_field(qc, source, ("bits", "w_bit"), 4)
        if bits != 4:
            raise ValueError(f"{source}.bits={bits} is not supported for AWQ; supported: 4")
        group_size = int_field(qc, source, ("group_size", "q_group_size"), 128)
        check_group_size(group_size, source)
        version = str(setting(qc, source, ("version", "checkpoint_format", "format"), "gemm")).lower()
        if version not in AWQ_VERSIONS:
            supported = ", ".join(map(repr, AWQ_VERSIONS))
            raise ValueError(
                f"{source}.version={version!r} is not supported for AWQ; supported: {supported} "
                "(re-export the model with version='gemm')"
            )
        if not bool_field(qc, source, ("zero_point",), True):
            raise ValueError(f"{source}.zero_point=false is not supported for AWQ; supported: true")
        skip = module_names(qc, source, "modules_to_not_convert")
        return cls(group_size=group_size, bits=bits, modules_to_not_convert=skip)

    def get_linear_method(self, prefix: str) -> LinearMethod:
        if is_skipped(prefix, self.modules_to_not_convert, self.packed_modules):
            return unquantized_method()
        return AwqLinearMethod(self)


class AwqLinearMethod(LinearMethod):
    def __init__(self, config: AwqConfig):
        self.config = config

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        where = getattr(layer, "prefix", "") or "a linear layer"
        # group_size -1 is one group over all of K: a row-parallel rank keeps it whole (replicated along K).
        g = input_size if self.config.group_size == -1 else self.config.group_size
        if input_size % g:
            raise ValueError(
                input_share_error(layer, input_size, g, f"AWQ group_size {g}")
                or f"{where}: AWQ group_size {g} does not divide the input size {input_size}; the checkpoint and the "
                "model config disagree"
            )
        bad = [n for n in output_sizes if n % 8]
        if bad:
            raise ValueError(
                output_share_error(layer, output_sizes, 8, "AWQ packs 8 columns per int32 word")
                or f"{where}: AWQ packs 8 output columns per int32 word; output sizes {bad} are not"
            )
        n = sum(output_sizes)
        words = [size // 8 for size in output_sizes]
        groups = None if self.config.group_size == -1 else (0, Fraction(1, g))  # [K // g] rows, or one kept whole
        word = Fraction(1, 8)
        # name: (tensor, shard widths, required dtype, (dim, ratio) along N, (dim, ratio) along K)
        tensors = {
            "qweight": (torch.zeros(input_size, n // 8, dtype=torch.int32), words, torch.int32, (1, word), (0, 1)),
            "qzeros": (torch.zeros(input_size // g, n // 8, dtype=torch.int32), words, torch.int32, (1, word), groups),
            # fp16 as AutoAWQ writes them; other float checkpoints are cast on load.
            "scales": (torch.zeros(input_size // g, n, dtype=torch.float16), list(output_sizes), None, (1, 1), groups),
        }
        for name, (data, widths, dtype, n_axis, k_axis) in tensors.items():
            param = nn.Parameter(data, requires_grad=False)
            param.weight_loader = make_column_loader(widths, name, dtype)
            set_shard_axes(param, output=n_axis, input=k_axis)
            layer.register_parameter(name, param)
        layer.awq_group_size = g

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "awq_layout", None) == "gptq":
            return
        with torch.no_grad():
            qweight, qzeros = repack_awq_as_gptq(layer.qweight.data, layer.qzeros.data)
            layer.qweight.data = qweight  # [K // 8, N]
            layer.qzeros.data.copy_(qzeros)  # same shape, column order
        layer.awq_layout = "gptq"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if getattr(layer, "awq_layout", None) != "gptq":
            raise RuntimeError("AWQ layer used before process_weights_after_loading")
        # AWQ zeros are the zeros themselves: zero offset 0.
        return gptq_gemm(x, layer.qweight, layer.qzeros, layer.scales, 4, layer.awq_group_size, 0, None, bias)
