"""Tensor-parallel linear layers (Megatron's split, as vLLM does it): each rank builds and loads only its share.

A transformer block pairs them so that the only communication is one all-reduce per block:
    ColumnParallelLinear / QKVParallelLinear: W [N, K] split along N; x replicated in, y split out (no collective).
    RowParallelLinear: W split along K; x split in (the column layer's output), partial sums all-reduced out.
With one rank (no tensor-parallel group) each is the plain `Linear` and runs exactly as it.
"""

from __future__ import annotations

import torch

from tritonllm.distributed.communication import tp_all_reduce
from tritonllm.distributed.parallel_state import get_tp_group
from tritonllm.models.layers.linear import Linear
from tritonllm.models.layers.sharding import LinearPartition
from tritonllm.quant.base import QuantConfig
from tritonllm.quant.common import output_names


def _as_list(sizes: list[int] | int) -> list[int]:
    return [sizes] if isinstance(sizes, int) else list(sizes)


class ColumnParallelLinear(Linear):
    """y[..., share of each output] = x @ W_r^T: every logical output N_i is cut into W equal column blocks and
    rank r holds block r of each (gate_up_proj -> [gate[r]; up[r]]), so a fused layer's outputs stay side by side.
    Input replicated, output split: output_sizes here are the rank's shares."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int] | int,
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
    ):
        tp = get_tp_group()
        sizes = _as_list(output_sizes)
        for name, n in zip(output_names(prefix, len(sizes)), sizes, strict=True):
            if n % tp.world_size:
                raise ValueError(
                    f"{prefix or 'a column-parallel layer'}: {name}'s {n} output features cannot be split evenly over "
                    f"tensor_parallel_size={tp.world_size}; choose a tensor_parallel_size that divides {n}"
                )
        local = [n // tp.world_size for n in sizes]
        part = LinearPartition(
            tp.rank, tp.world_size, input_size, sizes, 0, input_size, [tp.rank * n for n in local], local
        )
        super().__init__(input_size, sizes, bias, quant_config, prefix, params_dtype, partition=part)


class QKVParallelLinear(Linear):
    """[q; k; v] = x @ W^T split by attention heads: rank r holds query heads r*H/W .. (r+1)*H/W - 1 and the KV heads
    they read. KV heads are split likewise when W <= num_kv_heads (W must divide them), else each KV head is
    replicated on W / num_kv_heads ranks (W must be a multiple of num_kv_heads): rank r holds KV head
    r // (W // num_kv_heads). `num_heads` / `num_kv_heads` are the rank's counts."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
    ):
        tp = get_tp_group()
        w, rank = tp.world_size, tp.rank
        where = prefix or "a QKV layer"
        if num_heads % w:
            raise ValueError(
                f"{where}: num_attention_heads={num_heads} cannot be split over tensor_parallel_size={w}; "
                "tensor_parallel_size must divide it"
            )
        if (num_kv_heads >= w and num_kv_heads % w) or (num_kv_heads < w and w % num_kv_heads):
            raise ValueError(
                f"{where}: num_key_value_heads={num_kv_heads} cannot be split over tensor_parallel_size={w}; "
                "tensor_parallel_size must divide it (or be a multiple of it, each KV head then replicated on "
                "tensor_parallel_size / num_key_value_heads ranks)"
            )
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        local_heads = num_heads // w
        local_kv_heads = max(1, num_kv_heads // w)
        kv_rank = rank if num_kv_heads >= w else rank // (w // num_kv_heads)
        q, kv = num_heads * head_size, num_kv_heads * head_size
        q_local, kv_local = local_heads * head_size, local_kv_heads * head_size
        part = LinearPartition(
            rank,
            w,
            hidden_size,
            [q, kv, kv],
            0,
            hidden_size,
            [rank * q_local, kv_rank * kv_local, kv_rank * kv_local],
            [q_local, kv_local, kv_local],
        )
        super().__init__(hidden_size, [q, kv, kv], bias, quant_config, prefix, params_dtype, partition=part)
        self.head_size = head_size
        self.num_heads = local_heads
        self.num_kv_heads = local_kv_heads


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r @ W_r^T (+ b): rank r holds input features r*K/W .. (r+1)*K/W - 1 and takes x
    already split that way (a column-parallel layer's output). One all-reduce sums the partial products; the bias,
    kept whole on every rank, is added once after it."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int] | int,
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
    ):
        tp = get_tp_group()
        sizes = _as_list(output_sizes)
        if input_size % tp.world_size:
            raise ValueError(
                f"{prefix or 'a row-parallel layer'}: its {input_size} input features cannot be split evenly over "
                f"tensor_parallel_size={tp.world_size}; choose a tensor_parallel_size that divides {input_size}"
            )
        k = input_size // tp.world_size
        part = LinearPartition(tp.rank, tp.world_size, input_size, sizes, tp.rank * k, k, [0] * len(sizes), sizes)
        super().__init__(input_size, sizes, bias, quant_config, prefix, params_dtype, partition=part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.linear_method.apply(self, x, self.bias)
        y = tp_all_reduce(self.linear_method.apply(self, x, None))
        return y if self.bias is None else y.add_(self.bias)
