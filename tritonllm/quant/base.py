"""The interface between linear layers and weight formats.

A `LinearMethod` owns a layer's weight parameters: it creates them, knows how checkpoint tensors load into
them (including fused layers such as qkv_proj built from q/k/v shards), finishes them after loading
(repacking, permuting), and computes the layer. Linear layers never branch on the format.
"""

from abc import ABC, abstractmethod

import torch
from torch import nn


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
        `weight_loader(param, loaded_weight, shard_index: int | None)` attribute used by the model loader.
        """

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ W^T + bias for x [..., input_size] -> [..., sum(output_sizes)]."""

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
