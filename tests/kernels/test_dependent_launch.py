"""Programmatic dependent launch: kernels that start before their predecessor has finished must still see its
output. A chain of kernels where each reads the one before runs eagerly and, where CUDA exists, as a CUDA graph
replayed over fresh inputs, against the references."""

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import DEVICE, assert_close, dtypes, randn, seeds
from tritonllm.kernels import dependent_launch as dl
from tritonllm.kernels.activation import silu_and_mul, silu_and_mul_ref
from tritonllm.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from tritonllm.platform import INTERPRET

ON_GPU = DEVICE.type == "cuda" and not INTERPRET


def _chain(x, residual, w1, w2):
    """norm(x + residual) -> silu_and_mul -> norm: each kernel reads the previous one's output."""
    h = fused_add_rms_norm(x, residual, w1, 1e-6)
    return rms_norm(silu_and_mul(h), w2, 1e-6)


def _chain_ref(x, residual, w1, w2):
    h, new_residual = fused_add_rms_norm_ref(x, residual, w1, 1e-6)
    return rms_norm_ref(silu_and_mul_ref(h.to(x.dtype)).to(x.dtype), w2, 1e-6), new_residual


def test_on_only_for_compiled_kernels_on_hopper_and_later():
    assert dl.dependent_launch(torch.device("cpu")) == {"PDL": False}
    on = ON_GPU and torch.cuda.get_device_capability(DEVICE)[0] >= 9 and os.environ.get("TRITONLLM_PDL") != "0"
    assert dl.dependent_launch(DEVICE) == ({"PDL": True, "launch_pdl": True} if on else {"PDL": False})


def test_environment_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("TRITONLLM_PDL", "0")
    dl._supported.cache_clear()
    try:
        assert dl._supported(0) is False  # decided before asking the GPU anything
    finally:
        monkeypatch.undo()
        dl._supported.cache_clear()


@settings(max_examples=4)
@given(tokens=st.sampled_from([1, 3, 17]), inter=st.sampled_from([8, 40, 1151]), dtype=dtypes, seed=seeds())
def test_each_kernel_of_a_chain_sees_the_one_before(tokens, inter, dtype, seed):
    x = randn(tokens, 2 * inter, dtype=dtype, seed=seed, scale=2.0)
    residual = randn(tokens, 2 * inter, dtype=dtype, seed=seed + 1)
    w1 = randn(2 * inter, dtype=dtype, seed=seed + 2)
    w2 = randn(inter, dtype=dtype, seed=seed + 3)
    expected, expected_residual = _chain_ref(x, residual, w1, w2)
    assert_close(_chain(x, residual, w1, w2), expected, scale=4.0)
    assert_close(residual, expected_residual)
    if not ON_GPU:
        return
    # Captured once, replayed over inputs rewritten in place: the graph keeps the programmatic edges.
    static = [t.clone() for t in (x, residual, w1, w2)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(*static)
    for step in range(3):
        fresh = [randn(*t.shape, dtype=dtype, seed=seed + 10 * step + i) for i, t in enumerate(static)]
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        expected, expected_residual = _chain_ref(*fresh)
        assert_close(out, expected, scale=4.0)
        assert_close(static[1], expected_residual)
