import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import DEVICE, dtypes, randn, seeds
from tritonllm.kernels.kv_cache import write_kv_cache, write_kv_cache_ref

head_sizes = st.sampled_from([5, 64, 80, 96, 128, 256])
block_sizes = st.sampled_from([8, 16, 32])
kv_heads = st.sampled_from([1, 2, 3, 8])
token_counts = st.sampled_from([1, 5, 16, 123])


def _key_value(num_tokens: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, seed: int, fused: bool):
    """Random [T, Hk, D] keys and values; `fused` makes them strided views of a qkv projection output."""
    if not fused:
        return (
            randn(num_tokens, num_kv_heads, head_size, dtype=dtype, seed=seed),
            randn(num_tokens, num_kv_heads, head_size, dtype=dtype, seed=seed + 1),
        )
    num_q_heads = 2 * num_kv_heads
    qkv = randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_size, dtype=dtype, seed=seed)
    k_lo, v_lo = num_q_heads * head_size, (num_q_heads + num_kv_heads) * head_size
    key = qkv[:, k_lo:v_lo].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, v_lo:].view(num_tokens, num_kv_heads, head_size)
    assert num_tokens == 1 or key.stride(0) > num_kv_heads * head_size
    return key, value


def _slots(num_tokens: int, num_slots: int, seed: int, skip_fraction: float) -> torch.Tensor:
    """Distinct random slots, about `skip_fraction` of them -1."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    skip = torch.rand(num_tokens, generator=g) < skip_fraction
    return torch.where(skip, -1, slots).to(device=DEVICE)


@given(
    num_tokens=token_counts,
    num_kv_heads=kv_heads,
    head_size=head_sizes,
    block_size=block_sizes,
    dtype=dtypes,
    fused=st.booleans(),
    skip_fraction=st.sampled_from([0.0, 0.3]),
    seed=seeds(),
)
def test_write_kv_cache_matches_reference(
    num_tokens, num_kv_heads, head_size, block_size, dtype, fused, skip_fraction, seed
):
    num_blocks = num_tokens // block_size + 3
    key, value = _key_value(num_tokens, num_kv_heads, head_size, dtype, seed, fused)
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, seed=seed + 2)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, seed=seed + 3)
    slots = _slots(num_tokens, num_blocks * block_size, seed, skip_fraction)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()

    write_kv_cache(key, value, k_cache, v_cache, slots)
    write_kv_cache_ref(key, value, k_expected, v_expected, slots)

    # A copy is exact: compare every element of the whole cache, written slots and untouched ones alike.
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


@given(num_kv_heads=kv_heads, block_size=block_sizes, dtype=dtypes, seed=seeds())
def test_skipped_slots_write_nothing(num_kv_heads, block_size, dtype, seed):
    num_tokens, head_size, num_blocks = 5, 64, 3
    key, value = _key_value(num_tokens, num_kv_heads, head_size, dtype, seed, fused=False)
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, seed=seed + 2)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, seed=seed + 3)
    k_bytes = k_cache.view(torch.uint8).clone()
    v_bytes = v_cache.view(torch.uint8).clone()

    write_kv_cache(key, value, k_cache, v_cache, torch.full((num_tokens,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache.view(torch.uint8), k_bytes)
    assert torch.equal(v_cache.view(torch.uint8), v_bytes)

    # One real slot among the skipped ones: only that slot's bytes change.
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=DEVICE)
    slots[2] = block_size + 1
    write_kv_cache(key, value, k_cache, v_cache, slots)
    changed = (k_cache.view(torch.uint8) != k_bytes).flatten(1).any(dim=1)  # per block
    assert changed.tolist() == [False, True, False]
    assert torch.equal(k_cache[1, 1], key[2]) and torch.equal(v_cache[1, 1], value[2])
    for b, s in [(0, slice(None)), (1, slice(0, 1)), (1, slice(2, None)), (2, slice(None))]:
        assert torch.equal(k_cache[b, s].view(torch.uint8), k_bytes[b, s])
        assert torch.equal(v_cache[b, s].view(torch.uint8), v_bytes[b, s])


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@settings(max_examples=2)
@given(dtype=st.sampled_from([torch.float16, torch.float32]), seed=seeds())
def test_offsets_past_int32(dtype, seed):
    # A cache of more than 2^31 elements whose last blocks are the ones used: slot * stride passes 2^31, so
    # 32-bit index arithmetic would write elsewhere. torch.empty on the CPU commits only the pages touched.
    block_size, num_kv_heads, head_size = 16, 2, 64
    block_elems = block_size * num_kv_heads * head_size
    num_blocks = 2**31 // block_elems + 4
    before = _resident_mib()
    k_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    assert k_cache.numel() > 2**31
    num_tokens = 7
    key, value = _key_value(num_tokens, num_kv_heads, head_size, dtype, seed, fused=True)
    first_slot = (num_blocks - 2) * block_size - 3  # crosses into the last two blocks
    slots = torch.arange(first_slot, first_slot + num_tokens, dtype=torch.int64, device=DEVICE)
    slots[4] = -1
    tail = slice(num_blocks - 3, None)
    k_cache[tail] = 0
    v_cache[tail] = 0

    write_kv_cache(key, value, k_cache, v_cache, slots)

    k_expected = torch.zeros_like(k_cache[tail])
    v_expected = torch.zeros_like(v_cache[tail])
    base = (num_blocks - 3) * block_size
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expected.view(-1, num_kv_heads, head_size)[slot - base] = key[t]
            v_expected.view(-1, num_kv_heads, head_size)[slot - base] = value[t]
    assert torch.equal(k_cache[tail], k_expected)
    assert torch.equal(v_cache[tail], v_expected)
    if DEVICE.type == "cpu":
        assert _resident_mib() - before < 256, "the sparse cache got committed; the test would need real memory"


def test_rejects_bad_inputs():
    key = torch.zeros(3, 2, 64, dtype=torch.float16, device=DEVICE)
    cache = torch.zeros(2, 16, 2, 64, dtype=torch.float16, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        write_kv_cache(key, key, cache, cache, slots.int())
    with pytest.raises(ValueError, match="dtype mismatch"):
        write_kv_cache(key, key, cache.float(), cache.float(), slots)
    with pytest.raises(ValueError, match="heads"):
        write_kv_cache(key[:, :1], key[:, :1], cache, cache, slots)
    with pytest.raises(ValueError, match="contiguous last"):
        write_kv_cache(key.transpose(0, 2).contiguous().transpose(0, 2), key, cache, cache, slots)
