"""Gated MLP activations: act(x[..., :I]) * x[..., I:] on a fused gate_up projection output."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.kernels.activation import gelu_tanh_and_mul, silu_and_mul


class SiluAndMul(nn.Module):
    """[..., 2I] -> [..., I]: silu(gate) * up."""

    kind = "silu"  # the name fused kernels take (tritonllm.kernels.activation.GATED_ACTIVATIONS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """[..., 2I] -> [..., I]: gelu_tanh(gate) * up."""

    kind = "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(x)


# config.json `hidden_act` names (as transformers spells them) -> the fused gated activation.
_ACT_AND_MUL: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_tanh": GeluTanhAndMul,
    "gelu_new": GeluTanhAndMul,
}


def get_act_and_mul(hidden_act: str) -> nn.Module:
    cls = _ACT_AND_MUL.get(hidden_act)
    if cls is None:
        raise ValueError(f"hidden_act {hidden_act!r} is not supported; choose one of {', '.join(sorted(_ACT_AND_MUL))}")
    return cls()
