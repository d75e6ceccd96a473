"""The interface between linear layers and weight formats.

A `LinearMethod` owns a layer's weight parameters: it creates them, knows how checkpoint tensors load into
them (including fused layers such as qkv_proj built from q/k/v shards), finishes them after loading
(repacking, permuting), and computes the layer. Linear layers never branch on the format.
"""

from abc import ABC, abstractmethod
from fractions import Fraction

import torch
from torch import nn


def set_shard_axes(
    param: torch.Tensor,
    output: tuple[int, int | Fraction] | None,
    input: tuple[int, int | Fraction] | None,
) -> None:
    """Declare how `param`'s checkpoint tensor lies along the layer's logical axes, for tensor parallelism.

    `output` / `input` is (dim, ratio): dim of the checkpoint tensor that runs along N (outputs) / K (inputs), and
    ratio = that dim's length / the logical length (dense weight [N, K]: output (0, 1), input (1, 1); AWQ qweight
    [K, N / 8]: output (1, 1/8), input (0, 1); scales [K / g, N]: input (0, 1/g)). None: the tensor does not run
    along that axis (a bias along K) or every rank keeps all of it (GPTQ act-order scales along K). A parallel
    layer narrows each checkpoint tensor to the rank's range along its split axis with these before the
    parameter's own weight_loader places it.
    """
    param.output_dim, param.output_ratio = (None, None) if output is None else (output[0], Fraction(output[1]))
    param.input_dim, param.input_ratio = (None, None) if input is None else (input[0], Fraction(input[1]))


class LinearMethod(ABC):
    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        """Register the layer's weight parameters on `layer`.

        `output_sizes` lists the logical outputs fused into this layer in order (one entry for a plain
        linear; [q, k, v] sizes for qkv_proj; [gate, up] for gate_up_proj). Each parameter gets a
        `weight_loader(param, loaded_weight, shard_index: int | None)` attribute used by the model loader, and
        declares its axes with `set_shard_axes`. Under tensor parallelism the sizes are this rank's share; the
        layer's `full_input_size`, `input_is_parallel` and `tp_rank` say where that share sits (methods read
        them with getattr defaults, so a bare module works as one unsharded layer).
        """

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ W^T + bias for x [..., input_size] -> [..., sum(output_sizes)]."""

    def apply_gated(
        self, layer: nn.Module, x: torch.Tensor, activation: str, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """act(gate) * up [..., I] of a [gate; up] layer in one fused launch, or None where this method has none
        for these rows: the caller then runs `apply` and the activation kernel."""
        return None

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027  (optional hook)
        """Called once after every checkpoint tensor has loaded."""


class QuantConfig(ABC):
    """A checkpoint's weight format, parsed from config.json; hands each linear layer its method."""

    name: str

    @abstractmethod
    def get_linear_method(self, prefix: str) -> LinearMethod:
        """The method for the linear layer at `prefix` (e.g. "model.layers.0.self_attn.qkv_proj").

        Layers the checkpoint left unquantized (modules_to_not_convert, lm_head) get the unquantized method.
        """
