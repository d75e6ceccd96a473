"""Linear layers whose weights belong to a LinearMethod (dense here; AWQ/GPTQ in tritonllm.quant).

A fused layer (qkv_proj = [q; k; v], gate_up_proj = [gate; up]) stacks its logical outputs along the output
dimension; each checkpoint shard loads into its own row range through the parameter's `weight_loader`.
`Linear` is the whole layer on every rank; the tensor-parallel layers (parallel_linear.py) build on it with a
`LinearPartition`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.kernels.dense_gemv import dense_gemv
from tritonllm.kernels.dense_gemv_config import use_dense_gemv, use_gated_gemv
from tritonllm.models.layers.sharding import LinearPartition, shard_loaders
from tritonllm.quant.base import LinearMethod, QuantConfig, set_shard_axes


def _gemv_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_gemv: Callable[..., bool]
) -> torch.Tensor | None:
    """x as [rows, K] where the GEMV kernel may take this call (the rule `use_gemv` for these rows and this weight,
    one dtype, contiguous last dims), else None. Reads shapes, dtypes and strides only (no sync)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not (
        use_gemv(rows, x.device, x.dtype, weight_numel=weight.numel())
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    ):
        return None
    x2 = x.reshape(rows, k)
    return x2 if x2.stride(-1) == 1 else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ weight[N, K]^T (+ bias), as F.linear. A decode row on a Hopper-class GPU goes
    through the streaming GEMV kernel where `use_dense_gemv` says it beats cuBLAS; every other call, and every
    CPU run, is F.linear."""
    x2 = _gemv_rows(x, weight, bias, use_dense_gemv)
    if x2 is not None:
        return dense_gemv(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def gated_linear(
    x: torch.Tensor, weight: torch.Tensor, activation: str, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """act(x @ W_gate^T) * (x @ W_up^T) [..., I] for weight = [gate; up] in one GEMV launch where
    `use_gated_gemv` says the fused launch runs (decode rows on a Hopper-class GPU), else None: the caller runs
    `linear` and the activation kernel."""
    x2 = _gemv_rows(x, weight, bias, use_gated_gemv)
    if x2 is None:
        return None
    return dense_gemv(x2, weight, bias, activation=activation).view(*x.shape[:-1], weight.shape[0] // 2)


def _shard_rows(output_sizes: list[int], shard_index: int | None) -> tuple[int, int]:
    if shard_index is None:
        return 0, sum(output_sizes)
    if not 0 <= shard_index < len(output_sizes):
        raise ValueError(f"shard index {shard_index} out of range for a layer fused from {len(output_sizes)} outputs")
    start = sum(output_sizes[:shard_index])
    return start, output_sizes[shard_index]


def make_row_loader(output_sizes: list[int]):
    """A weight_loader for a parameter whose dim 0 is the fused output: shard i fills rows of output i."""

    def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_index: int | None = None) -> None:
        start, size = _shard_rows(output_sizes, shard_index)
        expected = (size, *param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"expected shape {list(expected)}, found {list(loaded_weight.shape)}")
        with torch.no_grad():
            param.data[start : start + size].copy_(loaded_weight)

    return weight_loader


class UnquantizedLinearMethod(LinearMethod):
    """Dense weight [sum(output_sizes), input_size] in the model dtype; y = x @ W^T (+ b) through `linear`."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        weight.weight_loader = make_row_loader(output_sizes)
        set_shard_axes(weight, output=(0, 1), input=(1, 1))  # [N, K]
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    def apply_gated(
        self, layer: nn.Module, x: torch.Tensor, activation: str, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        return gated_linear(x, layer.weight, activation, bias)


class Linear(nn.Module):
    """y = x @ W^T + b for x [..., input_size] -> [..., sum(output_sizes)], the whole layer on every rank.

    `prefix` is the layer's parameter path ("model.layers.0.self_attn.qkv_proj"); a QuantConfig uses it to pick
    the layer's method (layers a checkpoint left unquantized get the dense one). `partition` (the parallel
    layers') makes the layer this rank's share: input_size / output_sizes are then the share's, full_input_size /
    full_output_sizes the checkpoint's, and every parameter loads the rank's slice of its checkpoint tensor.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int] | int,
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        *,
        partition: LinearPartition | None = None,
    ):
        super().__init__()
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        part = partition or LinearPartition.replicated(input_size, sizes)
        self.input_size = part.input_size
        self.output_sizes = list(part.output_sizes)
        self.output_size = sum(self.output_sizes)
        self.full_input_size = part.full_input_size
        self.full_output_sizes = list(part.full_output_sizes)
        self.tp_rank, self.tp_size = part.rank, part.world_size
        self.input_is_parallel = part.input_split
        self.prefix = prefix
        params_dtype = params_dtype or torch.get_default_dtype()
        if quant_config is None:
            self.linear_method: LinearMethod = UnquantizedLinearMethod()
        else:
            self.linear_method = quant_config.get_linear_method(prefix)
        self.linear_method.create_weights(self, self.input_size, self.output_sizes, params_dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size, dtype=params_dtype), requires_grad=False)
            self.bias.weight_loader = make_row_loader(self.output_sizes)
            set_shard_axes(self.bias, output=(0, 1), input=None)
        else:
            self.register_parameter("bias", None)
        if part.is_sharded:
            shard_loaders(self, part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)

    def forward_gated(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """For a [gate; up] layer: act(gate) * up in one fused launch where the method has one for these rows,
        else None (then run `forward` and the activation)."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            raise ValueError(f"forward_gated needs a layer fused from two equal outputs, got {self.output_sizes}")
        return self.linear_method.apply_gated(self, x, activation, self.bias)

    def extra_repr(self) -> str:
        tp = f", tp={self.tp_rank}/{self.tp_size}" if self.tp_size > 1 else ""
        return (
            f"in={self.input_size}, out={self.output_sizes}, bias={self.bias is not None}, prefix={self.prefix!r}{tp}"
        )
