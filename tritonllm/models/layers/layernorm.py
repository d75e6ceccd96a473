"""RMSNorm over the last dim, with the residual add fused in when a residual stream is passed."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from tritonllm.models.layers.weights import default_weight_loader


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim (size `hidden_size`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: returns norm(x). With it: residual += x in place, returns (norm(residual), residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps), residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
