"""Programmatic dependent launch: kernels that start before their predecessor has finished must still see its
output, and what they read before waiting (the GEMV's weights) must be right too. Chains of kernels where each
reads the one before run eagerly and, where CUDA exists, as a CUDA graph replayed over fresh inputs, against the
references."""

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import DEVICE, assert_close, dtypes, randn, seeds
from tests.kernels.test_paged_attention import make_batch
from tests.kernels.test_rope import cos_sin_cache
from tritonllm.kernels import dependent_launch as dl
from tritonllm.kernels.activation import silu_and_mul, silu_and_mul_ref
from tritonllm.kernels.dense_gemv import dense_gemv
from tritonllm.kernels.kv_cache import write_kv_cache_ref
from tritonllm.kernels.paged_attention import paged_attention, paged_attention_ref
from tritonllm.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from tritonllm.kernels.rope import apply_rotary_and_cache, apply_rotary_ref
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
    if ON_GPU:
        _replay_over_fresh_inputs(lambda *t: (_chain(*t), t[1]), [x, residual, w1, w2], lambda f: _chain_ref(*f), seed)


def _replay_over_fresh_inputs(run, inputs, reference, seed):
    """Capture `run(*inputs)` (a tuple of outputs) once, then replay it three times over fresh values copied into
    `inputs` (the graph keeps the programmatic edges), each time against `reference(fresh)`, computed first."""
    inputs = [t.clone() for t in inputs]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(*inputs)
    for step in range(3):
        fresh = [randn(*t.shape, dtype=t.dtype, seed=seed + 10 * step + i) for i, t in enumerate(inputs)]
        expected = reference(fresh)
        for dst, src in zip(inputs, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        for out, want in zip(outs, expected, strict=True):
            assert_close(out, want, scale=4.0)


def _split_qkv(qkv, heads):
    hq, hk, d = heads
    return (
        qkv[:, : hq * d].view(-1, hq, d),
        qkv[:, hq * d : (hq + hk) * d].view(-1, hk, d),
        qkv[:, (hq + hk) * d :].view(-1, hk, d),
    )


def _decode_attention(x, w_qkv, batch, positions, slots, cos_sin, heads):
    """qkv GEMV -> rotary with the KV write -> paged attention (split over KV, merged): one decode layer's
    attention, each kernel reading the one before (the GEMV loads weights before its wait)."""
    q, k, v = _split_qkv(dense_gemv(x, w_qkv), heads)
    apply_rotary_and_cache(positions, q, k, v, cos_sin, True, batch.k_cache, batch.v_cache, slots)
    b = batch
    return paged_attention(
        q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables, 1, b.max_seq_len, b.scale, num_splits=3
    )


def _decode_attention_ref(x, w_qkv, batch, positions, slots, cos_sin, heads):
    q, k, v = _split_qkv((x.float() @ w_qkv.float().T).to(x.dtype), heads)
    q, k = apply_rotary_ref(positions, q, k, cos_sin, True)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    write_kv_cache_ref(k, v, k_cache, v_cache, slots)
    b = batch
    return paged_attention_ref(q, k_cache, v_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.scale)


@settings(max_examples=3)
@given(contexts=st.lists(st.integers(5, 90), min_size=1, max_size=3), dtype=dtypes, seed=seeds())
def test_decode_attention_chain_sees_each_kernel_before(contexts, dtype, seed):
    heads, hidden, block_size = (4, 2, 16), 48, 16
    hq, hk, d = heads
    batch = make_batch([(c, 1) for c in contexts], hk, hq // hk, d, block_size, dtype, seed)
    seq_lens = batch.seq_lens.tolist()
    positions = torch.tensor([n - 1 for n in seq_lens], device=DEVICE)
    slots = torch.tensor(
        [int(batch.block_tables[i, p // block_size]) * block_size + p % block_size for i, p in enumerate(positions)],
        device=DEVICE,
    )
    cos_sin = cos_sin_cache(d)
    x = randn(len(contexts), hidden, dtype=dtype, seed=seed + 4)
    w_qkv = randn((hq + 2 * hk) * d, hidden, dtype=dtype, seed=seed + 5, scale=hidden**-0.5)
    rest = (batch, positions, slots, cos_sin, heads)

    expected = _decode_attention_ref(x, w_qkv, *rest)
    assert_close(_decode_attention(x, w_qkv, *rest), expected, scale=4.0)
    if ON_GPU:
        _replay_over_fresh_inputs(
            lambda x_: (_decode_attention(x_, w_qkv, *rest),),
            [x],
            lambda f: (_decode_attention_ref(f[0], w_qkv, *rest),),
            seed,
        )
