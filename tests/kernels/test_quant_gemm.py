"""Fused quantized GEMM: y = x[:, perm] @ dequant(W) (+ bias) per activation dtype, for GPTQ-packed weights of
2, 4 and 8 bits (v1 / v2 zeros; AWQ is repacked into this layout), through the GEMV kernels (the paired fp16 one
for fp16 activations and 4-bit weights, the fp32 one otherwise), the tl.dot kernel (unsplit and split-K) and
dequantize + matmul, for groups that are whole tiles, whole words or narrower than a word."""

import dataclasses

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from tests.helpers import DEVICE, assert_close, dtypes, randn, seeds
from tritonllm.kernels.arrival_counters import _COUNTERS
from tritonllm.kernels.quant_dense import dense_weight
from tritonllm.kernels.quant_dequant import gptq_dequantize_ref
from tritonllm.kernels.quant_gemm import gptq_gemm, gptq_gemm_ref
from tritonllm.kernels.quant_gemm_config import (
    DEQUANT_MIN_M,
    HOPPER_TABLE,
    M_BUCKETS,
    QuantGemmConfig,
    check_config,
    generic_config,
    quant_gemm_config,
    sweep_candidates,
)
from tritonllm.platform import INTERPRET
from tritonllm.quant.pack import pack_bits

# The dot kernel rounds the dequantized weight to the activation dtype before the product, so the error is a
# little over one rounding of the output: twice the per-dtype tolerance.
TOL_SCALE = 2.0

# Small launches that still exercise several N tiles, K tiles and splits on tiny shapes.
KINDS = {
    "auto": None,
    "gemv": QuantGemmConfig(1, 32, 32, 1, 4, 2, gemv=True),  # next tile's loads issued one iteration ahead
    "gemv1": QuantGemmConfig(1, 32, 32, 1, 4, 1, gemv=True),  # no prefetch
    "gemv_rows": QuantGemmConfig(4, 32, 32, 1, 4, 2, gemv=True),  # paired fp16 GEMV: 4 rows per program
    "dot": QuantGemmConfig(16, 32, 32, 1, 4, 2),
    "dot_swap": QuantGemmConfig(16, 32, 32, 1, 4, 2, swap_ab=True),  # y^T = W^T x^T
    "dequant": QuantGemmConfig(1, 32, 32, 1, 4, 1, dequant=True),
}


def _config(kind: str, split: int) -> QuantGemmConfig | None:
    cfg = KINDS[kind]
    if cfg is None or cfg.dequant:  # dequantize + matmul does not split K
        return cfg
    return dataclasses.replace(cfg, split_k=split)


def _weights(k, n, bits, group_size, seed):
    """Random packed words (every field value, v1's all-ones zeros included) and scales sized for |y| ~ 1."""
    g = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    groups = -(-k // gs)  # a K that is no multiple of the group leaves a short last group
    qweight = pack_bits(torch.randint(0, 2**bits, (k, n), generator=g), bits, dim=0)
    qzeros = pack_bits(torch.randint(0, 2**bits, (groups, n), generator=g), bits, dim=1)
    scales = ((torch.rand(groups, n, generator=g) + 0.5) * 2.0 / (2**bits * k**0.5)).to(torch.float16)
    return qweight.to(DEVICE), qzeros.to(DEVICE), scales.to(DEVICE)


@given(
    seed=seeds(),
    m=st.sampled_from([1, 3, 16, 17, 64]),
    bits=st.sampled_from([2, 4, 8]),
    n_words=st.sampled_from([1, 5, 17]),
    k_words=st.sampled_from([5, 17, 41]),
    group_size=st.sampled_from([32, 64, 128, -1]),
    act_order=st.booleans(),
    zero_offset=st.sampled_from([0, 1]),
    has_bias=st.booleans(),
    dtype=dtypes,
    kind=st.sampled_from(list(KINDS)),
    split=st.sampled_from([1, 3]),
)
@example(
    seed=7, m=1, bits=4, n_words=17, k_words=41, group_size=128, act_order=True, zero_offset=1, has_bias=True,
    dtype=torch.bfloat16, kind="gemv", split=3,
)  # fmt: skip
@example(
    seed=8, m=16, bits=4, n_words=5, k_words=41, group_size=32, act_order=False, zero_offset=0, has_bias=True,
    dtype=torch.float16, kind="dot", split=3,
)  # fmt: skip
@example(
    seed=9, m=17, bits=8, n_words=17, k_words=17, group_size=64, act_order=True, zero_offset=1, has_bias=False,
    dtype=torch.bfloat16, kind="dot", split=1,
)  # fmt: skip
@example(
    seed=11, m=17, bits=4, n_words=17, k_words=41, group_size=128, act_order=True, zero_offset=0, has_bias=True,
    dtype=torch.bfloat16, kind="dot_swap", split=3,
)  # fmt: skip
@example(
    seed=12, m=17, bits=4, n_words=5, k_words=17, group_size=32, act_order=True, zero_offset=1, has_bias=True,
    dtype=torch.float16, kind="gemv_rows", split=3,
)  # fmt: skip
@example(
    seed=10, m=3, bits=2, n_words=5, k_words=17, group_size=32, act_order=False, zero_offset=1, has_bias=False,
    dtype=torch.float32, kind="gemv", split=3,
)  # fmt: skip
@example(
    seed=13, m=DEQUANT_MIN_M + 3, bits=4, n_words=5, k_words=17, group_size=64, act_order=True, zero_offset=1,
    has_bias=True, dtype=torch.bfloat16, kind="auto", split=1,
)  # fmt: skip
def test_gemm_matches_reference(
    seed, m, bits, n_words, k_words, group_size, act_order, zero_offset, has_bias, dtype, kind, split
):
    pack = 32 // bits
    n, k = pack * n_words, pack * k_words
    qweight, qzeros, scales = _weights(k, n, bits, group_size, seed)
    g = torch.Generator().manual_seed(seed + 1)
    perm = torch.randperm(k, generator=g).to(torch.int32).to(DEVICE) if act_order else None
    x = randn(m, k, dtype=dtype, seed=seed + 2)
    bias = randn(n, dtype=dtype, seed=seed + 3) if has_bias else None
    y = gptq_gemm(x, qweight, qzeros, scales, bits, group_size, zero_offset, perm, bias, config=_config(kind, split))
    assert y.dtype == dtype and y.shape == (m, n)
    expected = gptq_gemm_ref(x, qweight, qzeros, scales, bits, group_size, zero_offset, perm, bias)
    assert_close(y, expected, dtype, scale=TOL_SCALE)


@pytest.mark.parametrize("kind", ["gemv", "gemv1", "dot", "dot_swap", "dequant"])
def test_group_narrower_than_a_word(kind):
    # 4-bit group of 4 rows: half a word per group, so scales change inside a packed word.
    k, n, bits, gs = 32, 16, 4, 4
    qweight, qzeros, scales = _weights(k, n, bits, gs, seed=3)
    x = randn(2, k, dtype=torch.float32, seed=4)
    y = gptq_gemm(x, qweight, qzeros, scales, bits, gs, 0, config=_config(kind, 2))
    assert_close(y, gptq_gemm_ref(x, qweight, qzeros, scales, bits, gs, 0), torch.float32)


def test_leading_dims_flatten_into_rows():
    qweight, qzeros, scales = _weights(64, 24, 4, 32, seed=5)
    x = randn(2, 3, 64, dtype=torch.float16, seed=6)
    y = gptq_gemm(x, qweight, qzeros, scales, 4, 32)
    assert y.shape == (2, 3, 24)
    assert_close(y, gptq_gemm_ref(x, qweight, qzeros, scales, 4, 32), torch.float16, scale=TOL_SCALE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["gemv", "gemv1", "gemv_rows", "dot", "dot_swap"])
def test_split_k_is_deterministic_and_leaves_its_counters_zeroed(kind, dtype):
    # The last program of a tile adds the partials in split order, whatever order the programs finished in, and
    # resets the tile's arrival counter for the next launch.
    qweight, qzeros, scales = _weights(256, 40, 4, 32, seed=11)
    x = randn(3, 256, dtype=dtype, seed=12)
    first = gptq_gemm(x, qweight, qzeros, scales, 4, 32, config=_config(kind, 4))
    again = gptq_gemm(x, qweight, qzeros, scales, 4, 32, config=_config(kind, 4))
    assert torch.equal(first, again)
    assert all(int(locks.abs().sum()) == 0 for locks in _COUNTERS.values())
    unsplit = gptq_gemm(x, qweight, qzeros, scales, 4, 32, config=_config(kind, 1))
    assert_close(first, unsplit, dtype, scale=TOL_SCALE)


@pytest.mark.parametrize(
    ("group_size", "block_k"), [(8, 32), (16, 64), (24, 32), (4, 32)]
)  # groups of 1, 2 and 3 words inside a tile; 4 (half a word) goes to the fp32 GEMV
@pytest.mark.parametrize("block_m", [1, 2, 8])
def test_paired_gemv_groups_inside_a_tile(group_size, block_k, block_m):
    # Scales and zeros change from one word row to the next within a K tile (zeros up to 16 with v1's offset).
    k, n = 96, 40
    qweight, qzeros, scales = _weights(k, n, 4, group_size, seed=group_size + block_m)
    x = randn(5, k, dtype=torch.float16, seed=block_k)
    cfg = QuantGemmConfig(block_m, 32, block_k, 2, 4, 2, gemv=True)
    y = gptq_gemm(x, qweight, qzeros, scales, 4, group_size, 1, config=cfg)
    expected = gptq_gemm_ref(x, qweight, qzeros, scales, 4, group_size, 1)
    assert_close(y, expected, torch.float16, scale=TOL_SCALE)


def test_paired_gemv_reads_strided_and_offset_rows():
    # x read as int32 words: a view whose rows are not 4-byte aligned, or whose K stride is not 1, is copied first.
    qweight, qzeros, scales = _weights(64, 24, 4, 32, seed=14)
    base = randn(4, 65, dtype=torch.float16, seed=15)
    cfg = QuantGemmConfig(2, 32, 32, 1, 4, 1, gemv=True)
    for x in (base[:, 1:], base.t().contiguous().t()[:, :64], randn(64, 3, dtype=torch.float16, seed=16).t()):
        y = gptq_gemm(x, qweight, qzeros, scales, 4, 32, 0, config=cfg)
        assert_close(y, gptq_gemm_ref(x, qweight, qzeros, scales, 4, 32, 0), torch.float16, scale=TOL_SCALE)


@given(
    seed=seeds(),
    bits=st.sampled_from([2, 4, 8]),
    n_words=st.sampled_from([1, 5, 17]),
    k_words=st.sampled_from([3, 17, 41]),
    group_size=st.sampled_from([8, 32, 64, 128, -1]),
    act_order=st.booleans(),
    zero_offset=st.sampled_from([0, 1]),
    dtype=dtypes,
    block_k=st.sampled_from([16, 32, 128]),
)
def test_dense_weight_is_the_reference_rounded_once(
    seed, bits, n_words, k_words, group_size, act_order, zero_offset, dtype, block_k
):
    # (q - z) * s in fp32 rounded once to the output dtype, bit for bit; with act-order, packed row i lands on
    # row perm[i] (the input feature it multiplies), so x @ W^T needs no gather of x.
    pack = 32 // bits
    n, k = pack * n_words, pack * k_words
    qweight, qzeros, scales = _weights(k, n, bits, group_size, seed)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed + 1)).to(torch.int32) if act_order else None
    g = k if group_size == -1 else group_size
    block_k = max(block_k, pack)
    w = dense_weight(
        qweight, qzeros, scales, None if perm is None else perm.to(DEVICE), bits, g, zero_offset, dtype, 32, block_k, 4
    )  # fmt: skip
    ref = gptq_dequantize_ref(qweight, qzeros, scales, None, bits, group_size, zero_offset)
    if perm is not None:
        ref = torch.empty_like(ref).index_copy_(0, perm.long().to(DEVICE), ref)
    assert w.shape == (k, n) and w.dtype == dtype
    if dtype == torch.bfloat16 and INTERPRET:
        # The interpreter truncates fp32 -> bf16 where compiled code rounds to nearest: within one bf16 ulp.
        torch.testing.assert_close(w.float(), ref, rtol=2**-7, atol=0)
    else:
        assert torch.equal(w, ref.to(dtype))


def test_permutation_selects_input_features():
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
    for kind in ("gemv", "gemv1", "dot", "dot_swap", "dequant"):
        y = gptq_gemm(x, qweight, qzeros, scales, bits, -1, zero_offset=0, perm=perm, config=_config(kind, 1))
        assert y.cpu().eq(6.0).all(), kind


def test_launch_heuristics():
    # The generic heuristics (quant_gemm_config prefers HOPPER_TABLE's measured rows on a GPU).
    h200 = 132  # SMs
    for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)):
        decode = generic_config(1, n, k, sms=h200)
        assert decode.gemv and decode.block_m == 1
        # The paired fp16 GEMV serves a few rows in one pass over the weights.
        rows = generic_config(2, n, k, sms=h200, paired=True)
        assert rows.gemv and rows.block_m == 2
        assert not generic_config(2, n, k, sms=h200).gemv
        assert not generic_config(3, n, k, sms=h200, paired=True).gemv
        # A batch of one still puts several programs on every SM.
        assert -(-n // decode.block_n) * decode.split_k >= 2 * h200
        small = generic_config(16, n, k, sms=h200)
        assert not small.gemv and small.block_m == 16
        assert -(-n // small.block_n) * small.split_k >= h200
        # Up to the crossover, wgmma-sized tl.dot tiles whose grid (with split-K) still fills the GPU.
        m = DEQUANT_MIN_M - 1
        large = generic_config(m, n, k, sms=h200)
        assert large.block_m >= 64 and not large.gemv and not large.dequant
        assert -(-m // large.block_m) * -(-n // large.block_n) * large.split_k >= h200
        # From the crossover on, one dense matmul after dequantizing (the fused kernels' MMA rate is far below).
        for m in (DEQUANT_MIN_M, 2048):
            many = generic_config(m, n, k, sms=h200)
            assert many.dequant and not many.gemv and many.split_k == 1


def test_every_candidate_and_table_row_is_a_valid_launch():
    for bits in (2, 4, 8):
        for low, high in M_BUCKETS:
            for m in {low, min(high, 4096)}:
                for paired in (False, True):
                    for cfg in sweep_candidates(m, paired):
                        check_config(QuantGemmConfig(**{**_fields(cfg), "split_k": 1}), bits)
                    check_config(quant_gemm_config(m, 4096, 4096, bits, sms=132, paired=paired), bits)
        for rule in HOPPER_TABLE:
            check_config(rule.config, bits)


def test_every_table_row_is_a_sweep_candidate():
    # The table is what `quant_gemm.py --sweep` picked, so a re-sweep can find each row again (split-K aside).
    for rule in HOPPER_TABLE:
        candidates = sweep_candidates(min(rule.m[1], 4096), rule.paired_only)
        assert dataclasses.replace(rule.config, split_k=0) in candidates or rule.config.dequant, rule


def test_table_rows_do_not_overlap():
    # The first matching row wins: two rows claiming one shape would leave the second one dead, unless the first
    # applies to the paired fp16 GEMV's operands only and the second to the rest.
    for i, a in enumerate(HOPPER_TABLE):
        for b in HOPPER_TABLE[i + 1 :]:
            shared = [max(x[0], y[0]) <= min(x[1], y[1]) for x, y in ((a.m, b.m), (a.n, b.n), (a.k, b.k))]
            assert not all(shared) or (a.paired_only and not b.paired_only), (a, b)
    # Every row covers whole M buckets, so the sweep's buckets describe the table.
    lows, highs = {low for low, _ in M_BUCKETS}, {high for _, high in M_BUCKETS}
    for rule in HOPPER_TABLE:
        assert rule.m[0] in lows and rule.m[1] in highs, rule


def _fields(cfg):
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (QuantGemmConfig(16, 32, 32, 1, 4, 2, gemv=True), "block_m <= 8"),
        (QuantGemmConfig(8, 32, 32, 1, 4, 2), ">= 16"),
        (QuantGemmConfig(16, 48, 32, 1, 4, 2), "powers of two"),
        (QuantGemmConfig(16, 32, 32, 0, 4, 2), "split_k"),
        (QuantGemmConfig(1, 32, 32, 1, 4, 1, gemv=True, dequant=True), "not both"),
        (QuantGemmConfig(1, 32, 32, 2, 4, 1, dequant=True), "does not split"),
        (QuantGemmConfig(1, 32, 12, 1, 4, 1, dequant=True), "powers of two"),
    ],
)
def test_bad_configs_are_refused(cfg, message):
    with pytest.raises(ValueError, match=message):
        check_config(cfg, 4)


def _call(x, qweight, qzeros, bits, **kwargs):
    scales = torch.zeros(qzeros.shape[0], qweight.shape[1], dtype=torch.float16, device=DEVICE)
    return lambda: gptq_gemm(x, qweight, qzeros, scales, bits, -1, **kwargs)


def _z(shape, dtype=torch.int32):
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (_call(_z((2, 32), torch.float16), _z((4, 8), torch.int64), _z((1, 1)), 4), "int32"),
        (_call(_z((2, 32), torch.float16), _z((4, 8)), _z((1, 2)), 4), "shapes"),
        (_call(_z((2, 32), torch.int32), _z((4, 8)), _z((1, 1)), 4), "activations"),
        (_call(_z((2, 32), torch.float16), _z((12, 8)), _z((1, 3)), 3), "dequantize"),
        (_call(_z((2, 32), torch.float16), _z((4, 8)), _z((1, 1)), 4, perm=_z((31,))), "perm"),
    ],
)
def test_gemm_rejects_bad_inputs(call, message):
    with pytest.raises(ValueError, match=message):
        call()
