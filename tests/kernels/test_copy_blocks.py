import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import DEVICE, dtypes, randn, seeds
from tritonllm.kernels.copy_blocks import copy_blocks, copy_blocks_ref

# Per-block payloads: [block_size, num_kv_heads, head_size] as a runner lays them out, plus odd flat ones.
block_shapes = st.sampled_from([(1,), (4, 1, 5), (16, 2, 64), (3, 1, 123), (1151,), (2, 3, 8)])


def _mapping(num_blocks: int, num_pairs: int, seed: int) -> torch.Tensor:
    """Distinct destinations; sources drawn (with repeats, as after a fork) from the other blocks."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g)
    num_pairs = min(num_pairs, num_blocks // 2)
    dst = perm[:num_pairs]
    others = perm[num_pairs:]
    src = others[torch.randint(0, others.numel(), (num_pairs,), generator=g)]
    return torch.stack([src, dst], dim=1).to(device=DEVICE, dtype=torch.int64).contiguous()


def _cache(num_layers, num_blocks, block_shape, dtype, seed, layer_major):
    if layer_major:  # [num_layers, 2, ...] storage seen as [2, num_layers, ...]: strided outer dims
        return randn(num_layers, 2, num_blocks, *block_shape, dtype=dtype, seed=seed).transpose(0, 1)
    return randn(2, num_layers, num_blocks, *block_shape, dtype=dtype, seed=seed)


@given(
    num_layers=st.sampled_from([1, 2, 3]),
    num_blocks=st.sampled_from([2, 5, 13]),
    block_shape=block_shapes,
    num_pairs=st.integers(min_value=1, max_value=5),
    layer_major=st.booleans(),
    dtype=dtypes,
    seed=seeds(),
)
def test_copy_blocks_matches_ref(num_layers, num_blocks, block_shape, num_pairs, layer_major, dtype, seed):
    cache = _cache(num_layers, num_blocks, block_shape, dtype, seed, layer_major)
    mapping = _mapping(num_blocks, num_pairs, seed + 1)
    expected = cache.clone()
    copy_blocks_ref(expected, mapping)
    before = cache.clone()
    copy_blocks(cache, mapping)
    # A copy is exact: every bit of every destination, and nothing else touched.
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)
    for src, dst in mapping.tolist():
        torch.testing.assert_close(cache[:, :, dst], before[:, :, src], rtol=0, atol=0)


def test_copy_blocks_empty_mapping_is_a_no_op():
    cache = randn(2, 2, 5, 4, 1, 5, dtype=torch.float16, seed=3)
    before = cache.clone()
    copy_blocks(cache, torch.empty(0, 2, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, before)


def test_copy_blocks_rejects_bad_inputs():
    cache = randn(2, 1, 5, 4, 1, 8, dtype=torch.float32, seed=4)
    pairs = torch.tensor([[0, 1]], device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        copy_blocks(cache, pairs.to(torch.int32))
    with pytest.raises(ValueError, match=r"\[P, 2\]"):
        copy_blocks(cache, pairs.view(2))
    with pytest.raises(ValueError, match=r"\[2, num_layers, num_blocks"):
        copy_blocks(cache[0], pairs)
    with pytest.raises(ValueError, match="block must be contiguous"):
        copy_blocks(cache.transpose(3, 5), pairs)
