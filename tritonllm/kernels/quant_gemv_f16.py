"""The W4A16 GEMV for fp16 activations: 4-bit weights to fp16 two values per instruction (launched by `gptq_gemm`).

The fp32 GEMV (quant_gemv.py) spends ~50 SASS instructions per packed word on sm_90 and is bound by issuing
them. Here a word becomes four half2 registers the way FasterTransformer's converters do it: a nibble OR-ed into
the mantissa of 1024 (0x6400) reads as the fp16 1024 + q, so one LOP3 yields two values; subtracting 1024 + z
(or, for the nibble at bit 4, scaling by 1/16 and subtracting 64 + z) gives q - z exactly, and one multiply by
the scale rounds (q - z) * s to fp16 exactly as the reference's fp16 weight. The dot with x then runs as half2
FMAs, 8 products per word summed in fp16 before one conversion to the fp32 accumulator: 13 instructions per word
to dequantize, 8 per word and row for the dot, so one pass over the weights serves BLOCK_M rows.

Word row r of column n holds K rows 8r .. 8r + 7; the half2 registers pair values (p, p + 4), p = 0..3, so x is
read as int32 words (two fp16 each) and re-paired to match. Inline PTX does not run under the interpreter:
there `dequant_pairs` and `dot_pairs` compute the same values with Triton ops on the same packed registers.
"""

import torch
import triton
import triton.language as tl

from tritonllm.kernels.dependent_launch import wait_for_previous_kernel
from tritonllm.kernels.quant_gemm_common import group_params, load_word_rows, store_output


def paired_gemv_applies(x_dtype: torch.dtype, scales_dtype: torch.dtype, bits: int, group: int, k: int) -> bool:
    """Whether `_quant_gemv_f16_kernel` takes these operands: fp16 activations and scales, 4-bit weights, groups of
    whole words (`group` rows; one group when group >= k)."""
    return x_dtype == scales_dtype == torch.float16 and bits == 4 and (group >= k or group % 8 == 0)


# Outputs $0-$3: half2 (q - z) * s of nibbles (0, 4), (1, 5), (2, 6), (3, 7). Inputs: $4 the word, $5 half2 of
# 1024 + z, $6 half2 of -(64 + z), $7 half2 of s.
_DEQUANT_PAIRS_PTX = tl.constexpr("""
{
.reg .b32 w8, sixteenth, v0, v1, v2, v3;
mov.b32 sixteenth, 0x2C002C00;
shr.b32 w8, $4, 8;
lop3.b32 v0, $4, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 v1, $4, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 v2, w8, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 v3, w8, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 v0, v0, $5;
fma.rn.f16x2 v1, v1, sixteenth, $6;
sub.f16x2 v2, v2, $5;
fma.rn.f16x2 v3, v3, sixteenth, $6;
mul.rn.f16x2 $0, v0, $7;
mul.rn.f16x2 $1, v1, $7;
mul.rn.f16x2 $2, v2, $7;
mul.rn.f16x2 $3, v3, $7;
}
""")

# Output $0: the fp32 sum of the 8 products of weight pairs $1-$4 with x pairs $5-$8.
_DOT_PAIRS_PTX = tl.constexpr("""
{
.reg .b32 sum2;
.reg .f16 lo, hi;
.reg .f32 flo, fhi;
mul.rn.f16x2 sum2, $1, $5;
fma.rn.f16x2 sum2, $2, $6, sum2;
fma.rn.f16x2 sum2, $3, $7, sum2;
fma.rn.f16x2 sum2, $4, $8, sum2;
mov.b32 {lo, hi}, sum2;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}
""")


@triton.jit
def _half(pair, HIGH: tl.constexpr):
    """The fp16 in the low or high 16 bits of an int32, as fp32."""
    bits = (pair >> 16) & 0xFFFF if HIGH else pair & 0xFFFF
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pair(lo, hi):
    """int32 holding fp16 `lo` in its low and fp16 `hi` in its high 16 bits."""
    lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo_bits | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _dequant_pairs_emulated(word, z1024, s2):
    z = ((z1024 & 0xFFFF) - 0x6400).to(tl.float32)
    s = _half(s2, False)
    w0 = (((word >> 0) & 0xF).to(tl.float32) - z) * s
    w1 = (((word >> 4) & 0xF).to(tl.float32) - z) * s
    w2 = (((word >> 8) & 0xF).to(tl.float32) - z) * s
    w3 = (((word >> 12) & 0xF).to(tl.float32) - z) * s
    w4 = (((word >> 16) & 0xF).to(tl.float32) - z) * s
    w5 = (((word >> 20) & 0xF).to(tl.float32) - z) * s
    w6 = (((word >> 24) & 0xF).to(tl.float32) - z) * s
    w7 = (((word >> 28) & 0xF).to(tl.float32) - z) * s
    return _pair(w0, w4), _pair(w1, w5), _pair(w2, w6), _pair(w3, w7)


@triton.jit
def dequant_pairs(word, z1024, z64, s2, INTERPRET: tl.constexpr):
    """Four half2 registers (int32) of the word's fp16 weights (q - z) * s, paired (p, p + 4) for p = 0..3.
    z1024, z64, s2: half2 bit patterns of 1024 + z, -(64 + z) and s (`pair_constants`)."""
    if INTERPRET:
        return _dequant_pairs_emulated(word, z1024, s2)
    else:
        return tl.inline_asm_elementwise(
            _DEQUANT_PAIRS_PTX,
            "=r,=r,=r,=r,r,r,r,r",
            [word, z1024, z64, s2],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )


@triton.jit
def _round16(v):
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def _dot_half(w0, w1, w2, w3, x0, x1, x2, x3, HIGH: tl.constexpr):
    acc = _round16(_half(w0, HIGH) * _half(x0, HIGH))
    acc = _round16(acc + _half(w1, HIGH) * _half(x1, HIGH))
    acc = _round16(acc + _half(w2, HIGH) * _half(x2, HIGH))
    return _round16(acc + _half(w3, HIGH) * _half(x3, HIGH))


@triton.jit
def dot_pairs(w0, w1, w2, w3, x0, x1, x2, x3, INTERPRET: tl.constexpr):
    """fp32 sum of the 8 products of half2 weight pairs w* and half2 x pairs x*, added in fp16 per half."""
    if INTERPRET:
        return _dot_half(w0, w1, w2, w3, x0, x1, x2, x3, False) + _dot_half(w0, w1, w2, w3, x0, x1, x2, x3, True)
    else:
        return tl.inline_asm_elementwise(
            _DOT_PAIRS_PTX,
            "=f,r,r,r,r,r,r,r,r",
            [w0, w1, w2, w3, x0, x1, x2, x3],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )


@triton.jit
def pair_constants(z, s):
    """half2 bit patterns of 1024 + z, -(64 + z) and s for int32 zeros z (0 <= z <= 16) and fp32 scales s (fp16
    values): 1024 + z is 0x6400 + z and 64 + z is 0x5400 + 16 z in fp16, both exact."""
    z1024 = 0x6400 + z
    z64 = 0xD400 + 16 * z  # sign bit set
    s16 = s.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return z1024 | (z1024 << 16), z64 | (z64 << 16), s16 | (s16 << 16)


@triton.jit
def _row_dot(acc, w0, w1, w2, w3, x32, row, M, offs_kw, mask_kw, stride_x_m, INTERPRET: tl.constexpr):
    """acc [KW, BLOCK_N] plus the products of the tile's weight pairs with x row `row` (none for rows >= M). x32
    reads x as int32 words, word 4r holding x[8r], x[8r + 1]; they are re-paired (p, p + 4) as the weights are."""
    base = row.to(tl.int64) * (stride_x_m // 2) + offs_kw.to(tl.int64) * 4
    mask = mask_kw & (offs_kw * 0 + row < M)  # (a tensor comparison: the interpreter rejects a scalar mask)
    j = tl.arange(0, 4)
    a = tl.load(x32 + base[:, None] + j[None, :], mask=mask[:, None], other=0)
    even, odd = tl.split(tl.reshape(a, (a.shape[0], 2, 2)))  # words (0, 2) and (1, 3) of each group of four
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    x0 = (a0 & 0xFFFF) | (a2 << 16)
    x1 = ((a0 >> 16) & 0xFFFF) | (a2 & -65536)
    x2 = (a1 & 0xFFFF) | (a3 << 16)
    x3 = ((a1 >> 16) & 0xFFFF) | (a3 & -65536)
    return acc + dot_pairs(w0, w1, w2, w3, x0[:, None], x1[:, None], x2[:, None], x3[:, None], INTERPRET)


@triton.jit
def _as_row(v, r: tl.constexpr, BLOCK_M: tl.constexpr):
    """[BLOCK_N] -> [BLOCK_M, BLOCK_N], v in row r and zeros elsewhere."""
    return tl.where(tl.arange(0, BLOCK_M)[:, None] == r, v[None, :], 0.0)


@triton.jit(do_not_specialize=["M"])  # rows vary per step: one variant for all (see paged_attention.py)
def _quant_gemv_f16_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    lock_ptr,
    M,
    N,
    K,
    k_per_split,
    split_k,
    stride_p_s,
    stride_x_m,  # in fp16 elements, even
    stride_x_k,  # 1: x is read as int32 words
    stride_qw_k,
    stride_qw_n,
    stride_qz_g,
    stride_qz_n,
    stride_s_g,
    stride_s_n,
    stride_out_m,
    stride_out_n,
    GROUP_SIZE: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    GROUPS: tl.constexpr,  # "tile": one group per K tile, "word": per word row (groups of whole words only)
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 1, 2, 4 or 8
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    KW: tl.constexpr = BLOCK_K // 8  # word rows per tile
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_n64 = offs_n.to(tl.int64)
    x32 = x_ptr.to(tl.pointer_type(tl.int32))
    row0 = pid_m * BLOCK_M

    # acc<r>[i, n]: this program's share of y[row0 + r, n] from word rows i of every tile, reduced over i at the end.
    # One named accumulator per row (up to 8) keeps each in the words' register layout.
    acc0 = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
    if BLOCK_M > 1:
        acc1 = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
    if BLOCK_M > 2:
        acc2 = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
    if BLOCK_M > 4:
        acc4 = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
        acc5 = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
        acc6 = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
        acc7 = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if PREFETCH:  # each tile's words loaded one iteration ahead; nothing past this split's K range is read
        words = load_word_rows(qweight_ptr, k_start, k_end, offs_n64, mask_n, stride_qw_k, stride_qw_n, 8, KW)
    # Weights, scales and zeros are no earlier kernel's output: the first tile is in flight while it drains.
    wait_for_previous_kernel(PDL)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PREFETCH:
            cur = words
            words = load_word_rows(qweight_ptr, k0 + BLOCK_K, k_end, offs_n64, mask_n, stride_qw_k, stride_qw_n, 8, KW)
        else:
            cur = load_word_rows(qweight_ptr, k0, k_end, offs_n64, mask_n, stride_qw_k, stride_qw_n, 8, KW)
        offs_kw = k0 // 8 + tl.arange(0, KW)
        mask_kw = offs_kw < K // 8
        if GROUPS == "tile":
            z, s = group_params(
                qzeros_ptr, scales_ptr, k0 // GROUP_SIZE, mask_n, offs_n, stride_qz_g, stride_qz_n, stride_s_g,
                stride_s_n, 4, ZERO_OFFSET,
            )  # fmt: skip
            z1024, z64, s2 = pair_constants(z[None, :], s[None, :])
        else:
            z, s = group_params(
                qzeros_ptr, scales_ptr, (offs_kw * 8 // GROUP_SIZE)[:, None], mask_kw[:, None] & mask_n[None, :],
                offs_n[None, :], stride_qz_g, stride_qz_n, stride_s_g, stride_s_n, 4, ZERO_OFFSET,
            )  # fmt: skip
            z1024, z64, s2 = pair_constants(z, s)
        w0, w1, w2, w3 = dequant_pairs(cur, z1024, z64, s2, INTERPRET)
        acc0 = _row_dot(acc0, w0, w1, w2, w3, x32, row0, M, offs_kw, mask_kw, stride_x_m, INTERPRET)
        if BLOCK_M > 1:
            acc1 = _row_dot(acc1, w0, w1, w2, w3, x32, row0 + 1, M, offs_kw, mask_kw, stride_x_m, INTERPRET)
        if BLOCK_M > 2:
            acc2 = _row_dot(acc2, w0, w1, w2, w3, x32, row0 + 2, M, offs_kw, mask_kw, stride_x_m, INTERPRET)
            acc3 = _row_dot(acc3, w0, w1, w2, w3, x32, row0 + 3, M, offs_kw, mask_kw, stride_x_m, INTERPRET)
        if BLOCK_M > 4:
            acc4 = _row_dot(acc4, w0, w1, w2, w3, x32, row0 + 4, M, offs_kw, mask_kw, stride_x_m, INTERPRET)
            acc5 = _row_dot(acc5, w0, w1, w2, w3, x32, row0 + 5, M, offs_kw, mask_kw, stride_x_m, INTERPRET)
            acc6 = _row_dot(acc6, w0, w1, w2, w3, x32, row0 + 6, M, offs_kw, mask_kw, stride_x_m, INTERPRET)
            acc7 = _row_dot(acc7, w0, w1, w2, w3, x32, row0 + 7, M, offs_kw, mask_kw, stride_x_m, INTERPRET)

    y = _as_row(tl.sum(acc0, axis=0), 0, BLOCK_M)
    if BLOCK_M > 1:
        y += _as_row(tl.sum(acc1, axis=0), 1, BLOCK_M)
    if BLOCK_M > 2:
        y += _as_row(tl.sum(acc2, axis=0), 2, BLOCK_M) + _as_row(tl.sum(acc3, axis=0), 3, BLOCK_M)
    if BLOCK_M > 4:
        y += _as_row(tl.sum(acc4, axis=0), 4, BLOCK_M) + _as_row(tl.sum(acc5, axis=0), 5, BLOCK_M)
        y += _as_row(tl.sum(acc6, axis=0), 6, BLOCK_M) + _as_row(tl.sum(acc7, axis=0), 7, BLOCK_M)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    store_output(
        y, offs_m, offs_n, pid_m * tl.num_programs(1) + pid_n, pid_s, M, N, split_k, stride_p_s, bias_ptr, out_ptr,
        partial_ptr, lock_ptr, stride_out_m, stride_out_n, HAS_BIAS, SPLIT,
    )  # fmt: skip
