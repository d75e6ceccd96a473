"""Shared test strategies, tolerances and the device tests run on."""

import torch
from hypothesis import strategies as st

from tritonllm.platform import default_device

DEVICE = default_device()

DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# assert_close tolerances per dtype, for kernels that compute in fp32 and round once on store.
TOLERANCES = {
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
}

dtypes = st.sampled_from(DTYPES)

# Sizes that keep the interpreter fast but always include odd ones that miss every power of two.
ODD_SIZES = [5, 123, 1151]
hidden_sizes = st.sampled_from([8, 64, 96] + ODD_SIZES)
num_tokens = st.sampled_from([1, 2, 7, 16, 33])


def seeds() -> st.SearchStrategy[int]:
    """A fresh torch seed per example: inputs are random, never zeros, and reproducible from the example."""
    return st.integers(min_value=0, max_value=2**31 - 1)


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, scale: float = 1.0):
    tol = TOLERANCES[dtype or actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol["atol"] * scale, rtol=tol["rtol"] * scale)
