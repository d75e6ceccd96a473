import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import DEVICE, assert_close, dtypes, num_tokens, randn, seeds
from tritonllm.kernels.kv_cache import write_kv_cache_ref
from tritonllm.kernels.rope import apply_rotary, apply_rotary_and_cache, apply_rotary_ref

MAX_POS = 300
head_dims = st.sampled_from([8, 64, 123, 128])
rotary_fractions = st.sampled_from([1.0, 0.5, 0.25])
head_counts = st.sampled_from([(1, 1), (4, 2), (5, 5), (8, 1), (40, 8)])  # (q heads, kv heads)


def cos_sin_cache(rot_dim: int, base: float = 10000.0, max_pos: int = MAX_POS) -> torch.Tensor:
    # Built here, independently of the rotary layer: row p = [cos(p * inv_freq) | sin(p * inv_freq)].
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().to(DEVICE)


def _rot_dim(head_dim: int, fraction: float) -> int:
    return max(2, int(head_dim * fraction) // 2 * 2)


def _fused_qkv(tokens, hq, hk, head_dim, dtype, seed, pad):
    """q, k as [T, H, D] views of one fused [T, (Hq + 2 Hk) D + pad] output, plus that output."""
    qkv = randn(tokens, (hq + 2 * hk) * head_dim + pad, dtype=dtype, seed=seed)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim)
    return qkv, q, k


@given(
    tokens=num_tokens,
    heads=head_counts,
    head_dim=head_dims,
    fraction=rotary_fractions,
    is_neox=st.booleans(),
    dtype=dtypes,
    pos_dtype=st.sampled_from([torch.int32, torch.int64]),
    pad=st.sampled_from([0, 3]),
    seed=seeds(),
)
def test_apply_rotary_matches_ref_on_fused_qkv_views(
    tokens, heads, head_dim, fraction, is_neox, dtype, pos_dtype, pad, seed
):
    hq, hk = heads
    rot_dim = _rot_dim(head_dim, fraction)
    cache = cos_sin_cache(rot_dim)
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=g).to(pos_dtype).to(DEVICE)
    qkv, q, k = _fused_qkv(tokens, hq, hk, head_dim, dtype, seed, pad)
    expected_q, expected_k = apply_rotary_ref(positions, q, k, cache, is_neox)
    untouched = qkv[:, (hq + hk) * head_dim :].clone()  # v and padding

    out_q, out_k = apply_rotary(positions, q, k, cache, is_neox)

    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert_close(q, expected_q)
    assert_close(k, expected_k)
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], untouched)


@given(
    heads=st.sampled_from([(40, 40), (64, 24), (17, 33)]),
    is_neox=st.booleans(),
    dtype=dtypes,
    seed=seeds(),
)
def test_apply_rotary_many_heads_span_several_head_blocks(heads, is_neox, dtype, seed):
    # head_dim 128 packs 16 heads per program: q and k each spill over several head blocks.
    hq, hk = heads
    tokens, head_dim = 3, 128
    cache = cos_sin_cache(head_dim)
    positions = torch.tensor([MAX_POS - 1, 1, 77], device=DEVICE)
    qkv, q, k = _fused_qkv(tokens, hq, hk, head_dim, dtype, seed, pad=0)
    expected_q, expected_k = apply_rotary_ref(positions, q, k, cache, is_neox)
    apply_rotary(positions, q, k, cache, is_neox)
    assert_close(q, expected_q)
    assert_close(k, expected_k)


@given(
    tokens=num_tokens,
    head_dim=head_dims,
    fraction=rotary_fractions,
    is_neox=st.booleans(),
    seed=seeds(),
)
def test_apply_rotary_is_a_rotation(tokens, head_dim, fraction, is_neox, seed):
    # fp32: each head's norm is preserved, dims past rot_dim pass through bit for bit, position 0 is the identity.
    rot_dim = _rot_dim(head_dim, fraction)
    cache = cos_sin_cache(rot_dim)
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=g).to(DEVICE)
    positions[0] = 0
    q = randn(tokens, 3, head_dim, dtype=torch.float32, seed=seed)
    k = randn(tokens, 1, head_dim, dtype=torch.float32, seed=seed + 1)
    q0, k0 = q.clone(), k.clone()
    apply_rotary(positions, q, k, cache, is_neox)
    for new, old in ((q, q0), (k, k0)):
        assert_close(new.norm(dim=-1), old.norm(dim=-1), scale=10)
        assert torch.equal(new[..., rot_dim:], old[..., rot_dim:])
        assert_close(new[0], old[0])
    moved = positions != 0
    if moved.any():
        assert not torch.equal(q[moved], q0[moved])


@given(dtype=dtypes, seed=seeds())
def test_apply_rotary_neox_and_gptj_differ_only_by_pair_layout(dtype, seed):
    # gptj on an interleaved head equals neox on the same head de-interleaved: ties both layouts together.
    head_dim, tokens = 64, 7
    cache = cos_sin_cache(head_dim)
    positions = torch.arange(3, 3 + tokens, device=DEVICE)
    x = randn(tokens, 2, head_dim, dtype=dtype, seed=seed)
    perm = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])  # interleaved -> halves
    gptj_q = x.clone()
    neox_q = x[..., perm].contiguous()
    apply_rotary(positions, gptj_q, gptj_q.clone(), cache, is_neox=False)
    apply_rotary(positions, neox_q, neox_q.clone(), cache, is_neox=True)
    assert_close(gptj_q[..., perm], neox_q)


@given(
    tokens=num_tokens,
    heads=head_counts,
    head_dim=head_dims,
    fraction=rotary_fractions,
    is_neox=st.booleans(),
    block_size=st.sampled_from([1, 16]),
    skip=st.sampled_from([0.0, 0.4]),
    dtype=dtypes,
    seed=seeds(),
)
def test_apply_rotary_and_cache_matches_rotary_then_cache_write(
    tokens, heads, head_dim, fraction, is_neox, block_size, skip, dtype, seed
):
    hq, hk = heads
    rot_dim = _rot_dim(head_dim, fraction)
    cache = cos_sin_cache(rot_dim)
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=g).to(DEVICE)
    qkv, q, k = _fused_qkv(tokens, hq, hk, head_dim, dtype, seed, pad=3)
    v = qkv[:, (hq + hk) * head_dim : (hq + 2 * hk) * head_dim].view(tokens, hk, head_dim)
    num_blocks = -(-2 * tokens // block_size)
    k_cache = randn(num_blocks, block_size, hk, head_dim, dtype=dtype, seed=seed + 1)  # old contents, not zeros
    v_cache = randn(num_blocks, block_size, hk, head_dim, dtype=dtype, seed=seed + 2)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots = torch.where(torch.rand(tokens, generator=g) < skip, -1, slots).to(DEVICE)
    expected_q, rotated_k = apply_rotary_ref(positions, q, k, cache, is_neox)
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(rotated_k, v, expected_k_cache, expected_v_cache, slots)
    k_before, v_before = k.clone(), v.clone()

    assert apply_rotary_and_cache(positions, q, k, v, cache, is_neox, k_cache, v_cache, slots) is q

    assert_close(q, expected_q)
    assert_close(k_cache, expected_k_cache)
    assert torch.equal(v_cache, expected_v_cache)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # k's rotation went to the cache only


def test_apply_rotary_and_cache_rejects_a_mismatched_cache():
    positions = torch.arange(4, device=DEVICE)
    q, k, v = (
        torch.randn(4, 2, 16, device=DEVICE),
        torch.randn(4, 1, 16, device=DEVICE),
        torch.randn(4, 1, 16, device=DEVICE),
    )
    slots = torch.arange(4, device=DEVICE)
    cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="cache holds 2 heads"):
        apply_rotary_and_cache(
            positions, q, k, v, cos_sin_cache(16), True, cache.repeat(1, 1, 2, 1), cache.repeat(1, 1, 2, 1), slots
        )
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        apply_rotary_and_cache(positions, q, k, v, cos_sin_cache(16), True, cache, cache.clone(), slots.int())
    with pytest.raises(ValueError, match="rot_dim"):
        apply_rotary_and_cache(positions, q, k, v, cos_sin_cache(32), True, cache, cache.clone(), slots)


def test_apply_rotary_rejects_bad_inputs():
    positions = torch.arange(4, device=DEVICE)
    q = torch.randn(4, 2, 16, device=DEVICE)
    k = torch.randn(4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        apply_rotary(positions, q, k, cos_sin_cache(16).half(), True)
    with pytest.raises(ValueError, match="rot_dim"):
        apply_rotary(positions, q, k, cos_sin_cache(32), True)
    with pytest.raises(ValueError, match="tokens"):
        apply_rotary(positions[:3], q, k, cos_sin_cache(16), True)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        apply_rotary(positions, q.transpose(1, 2), k, cos_sin_cache(16), True)
    with pytest.raises(ValueError, match=r"\[T, heads, head_dim\]"):
        apply_rotary(positions, q.view(4, 32), k, cos_sin_cache(16), True)
