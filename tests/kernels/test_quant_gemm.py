"""Fused W4A16 GEMM: y = x @ dequant(W) (+ bias) per activation dtype, for AWQ and GPTQ (2/4/8-bit, v1/v2 zeros,
act-order permutations), through both the split-K (small M) and the unsplit (large M) launch."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from tests.helpers import DEVICE, assert_close, dtypes, randn, seeds
from tritonllm.kernels.quant_gemm import awq_gemm, awq_gemm_ref, gptq_gemm, gptq_gemm_ref
from tritonllm.kernels.quant_gemm_config import QuantGemmConfig, quant_gemm_config
from tritonllm.quant.pack import pack_awq_int, pack_bits

# Operands are rounded to the activation dtype before the dot (the weight after dequantization), so the error is
# a little over one rounding of the output: twice the per-dtype tolerance.
TOL_SCALE = 2.0

# None: the heuristic's choice for this M; otherwise force the split-K or the unsplit launch.
splits = st.sampled_from([None, 1, 3])


def _config(m, n, k, group_size, split):
    cfg = quant_gemm_config(m, n, k, group_size)
    if split is None:
        return None
    return QuantGemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, split, cfg.num_warps, cfg.num_stages)


def _scales(groups, n, k, bits, g):
    # Scaled so that y has unit size: w ~ 2**bits * s ~ 1 / sqrt(K).
    return ((torch.rand(groups, n, generator=g) + 0.5) * 2.0 / (2**bits * k**0.5)).to(torch.float16)


@given(
    seed=seeds(),
    m=st.sampled_from([1, 5, 33, 123]),
    n_words=st.sampled_from([1, 5, 17]),
    group_size=st.sampled_from([32, 64, 128, -1]),
    k_groups=st.sampled_from([1, 3]),
    dtype=dtypes,
    split=splits,
    has_bias=st.booleans(),
)
@example(seed=9, m=1, n_words=17, group_size=128, k_groups=3, dtype=torch.bfloat16, split=3, has_bias=True)
def test_awq_gemm_matches_reference(seed, m, n_words, group_size, k_groups, dtype, split, has_bias):
    g = torch.Generator().manual_seed(seed)
    n = 8 * n_words
    k = (group_size if group_size > 0 else 40) * k_groups
    groups = 1 if group_size == -1 else k // group_size
    qweight = pack_awq_int(torch.randint(0, 16, (k, n), generator=g)).to(DEVICE)
    qzeros = pack_awq_int(torch.randint(0, 16, (groups, n), generator=g)).to(DEVICE)
    scales = _scales(groups, n, k, 4, g).to(DEVICE)
    x = randn(m, k, dtype=dtype, seed=seed + 1)
    bias = randn(n, dtype=dtype, seed=seed + 2) if has_bias else None
    y = awq_gemm(x, qweight, qzeros, scales, group_size, bias, config=_config(m, n, k, group_size, split))
    assert y.dtype == dtype and y.shape == (m, n)
    assert_close(y, awq_gemm_ref(x, qweight, qzeros, scales, group_size, bias), dtype, scale=TOL_SCALE)


@given(
    seed=seeds(),
    m=st.sampled_from([1, 5, 33, 123]),
    bits=st.sampled_from([2, 4, 8]),
    n=st.sampled_from([16, 80, 144]),
    k=st.sampled_from([64, 80, 192]),
    group_size=st.sampled_from([32, 64, -1]),
    act_order=st.booleans(),
    zero_offset=st.sampled_from([0, 1]),
    dtype=dtypes,
    split=splits,
)
@example(seed=7, m=1, bits=4, n=80, k=80, group_size=32, act_order=True, zero_offset=1, dtype=torch.bfloat16, split=3)
@example(seed=8, m=33, bits=8, n=144, k=192, group_size=64, act_order=True, zero_offset=0, dtype=torch.float16, split=1)
def test_gptq_gemm_matches_reference(seed, m, bits, n, k, group_size, act_order, zero_offset, dtype, split):
    g = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    groups = -(-k // gs)  # k = 80 leaves a short last group
    qweight = pack_bits(torch.randint(0, 2**bits, (k, n), generator=g), bits, dim=0).to(DEVICE)
    # Random zero fields include all-ones, which v1 (zero_offset 1) reads as 2**bits.
    qzeros = pack_bits(torch.randint(0, 2**bits, (groups, n), generator=g), bits, dim=1).to(DEVICE)
    scales = _scales(groups, n, k, bits, g).to(DEVICE)
    perm = torch.randperm(k, generator=g).to(torch.int32).to(DEVICE) if act_order else None
    x = randn(3, m, k, dtype=dtype, seed=seed + 1)  # leading dims flatten into M
    y = gptq_gemm(
        x, qweight, qzeros, scales, bits, group_size, zero_offset, perm, config=_config(3 * m, n, k, gs, split)
    )
    assert y.dtype == dtype and y.shape == (3, m, n)
    expected = gptq_gemm_ref(x, qweight, qzeros, scales, bits, group_size, zero_offset, perm)
    assert_close(y, expected, dtype, scale=TOL_SCALE)


def test_gptq_gemm_permutation_selects_input_features():
    # One nonzero weight row: row i of the packed weight multiplies x[:, perm[i]].
    k, n, bits = 32, 16, 4
    ints = torch.zeros(k, n, dtype=torch.int64)
    ints[0] = 3
    qweight = pack_bits(ints, bits, dim=0).to(DEVICE)
    qzeros = torch.zeros(1, n // 8, dtype=torch.int32, device=DEVICE)
    scales = torch.ones(1, n, dtype=torch.float16, device=DEVICE)
    perm = torch.arange(k, dtype=torch.int32).roll(-5).to(DEVICE)  # row 0 <- feature 5
    x = torch.zeros(1, k, dtype=torch.float32, device=DEVICE)
    x[0, 5] = 2.0
    y = gptq_gemm(x, qweight, qzeros, scales, bits, -1, zero_offset=0, perm=perm)
    assert y.cpu().eq(6.0).all()


def test_launch_heuristics():
    h200 = 132  # SMs
    small = quant_gemm_config(1, 4096, 4096, 128, sms=h200)
    tiles = 4096 // small.block_n
    assert small.block_m == 16 and 128 % small.block_k == 0
    assert small.split_k > 1 and tiles * small.split_k >= h200  # a batch of one still fills the GPU
    large = quant_gemm_config(2048, 4096, 4096, 128, sms=h200)
    assert large.split_k == 1 and large.block_m >= 64
    for group in (32, 64, 128):  # one K tile never spans two groups
        assert group % quant_gemm_config(1, 4096, 4096, group, sms=h200).block_k == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda z: awq_gemm(z((2, 32), torch.float16), z((32, 1)), z((1, 1)), z((1, 8), torch.float16), -1), "int32"),
        (
            lambda z: awq_gemm(
                z((2, 32), torch.float16), z((32, 2), torch.int32), z((1, 1), torch.int32), z((1, 8), torch.float16), -1
            ),
            "shapes",
        ),
        (
            lambda z: awq_gemm(
                z((2, 32), torch.int32), z((32, 1), torch.int32), z((1, 1), torch.int32), z((1, 8), torch.float16), -1
            ),
            "activations",
        ),
        (
            lambda z: gptq_gemm(
                z((2, 32), torch.float16),
                z((12, 8), torch.int32),
                z((1, 3), torch.int32),
                z((1, 8), torch.float16),
                3,
                -1,
            ),
            "dequantize",
        ),
        (
            lambda z: gptq_gemm(
                z((2, 32), torch.float16),
                z((4, 8), torch.int32),
                z((1, 1), torch.int32),
                z((1, 8), torch.float16),
                4,
                -1,
                perm=z((31,), torch.int32),
            ),
            "perm",
        ),
    ],
)
def test_gemm_rejects_bad_inputs(call, message):
    def z(shape, dtype=torch.int64):
        return torch.zeros(shape, dtype=dtype, device=DEVICE)

    with pytest.raises(ValueError, match=message):
        call(z)
