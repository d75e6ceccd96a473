"""Device code shared by the quantized GEMM kernels (quant_gemm.py, quant_gemv.py, quant_dense.py): dequantization
pieces and the output stage (bias, cast, split-K reduction), which the dense GEMV (dense_gemv.py) uses too.

Dequantization without int->float conversions (a quarter-rate instruction on Hopper): an integer i < 2^23 OR-ed
into the mantissa of 2^23 (bits 0x4B000000) reads as the fp32 2^23 + i exactly, so (2^23 + q) - (2^23 + z) is
q - z exactly, and one multiply by s matches the reference's (q - z) * s bit for bit.

Split-K without a second launch: each of a tile's SPLIT_K programs stores its fp32 partial sums to a workspace
[SPLIT_K, M, N], then increments the tile's arrival counter (acq_rel, GPU scope, after a CTA barrier so every
thread's stores precede it). The program that sees the count SPLIT_K - 1 arrived last: it reads all partials
(.cg: from L2, past the SM's non-coherent L1), adds them in split order, so the sum does not depend on the order
programs finished in, adds the bias, writes y and sets the counter back to 0. The counters come from
arrival_counters.py.
"""

import triton
import triton.language as tl


@triton.jit
def group_params(
    qzeros_ptr,
    scales_ptr,
    group,
    mask,
    offs_n,
    stride_qz_g,
    stride_qz_n,
    stride_s_g,
    stride_s_n,
    BITS: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
):
    """(z, s): the zero as int32 (zero offset included) and the scale as fp32, for columns `offs_n` of groups
    `group`, a scalar (-> [BLOCK_N]) or [R, 1] (-> [R, BLOCK_N]); `mask` has the result's shape."""
    PACK: tl.constexpr = 32 // BITS
    offs_n64 = offs_n.to(tl.int64)
    zwords = tl.load(qzeros_ptr + group * stride_qz_g + (offs_n64 // PACK) * stride_qz_n, mask=mask, other=0)
    z = ((zwords >> ((offs_n % PACK) * BITS)) & ((1 << BITS) - 1)) + ZERO_OFFSET
    s = tl.load(scales_ptr + group * stride_s_g + offs_n64 * stride_s_n, mask=mask, other=0.0)
    return z, s.to(tl.float32)


@triton.jit
def magic(i):
    """2^23 + i as fp32, exactly, for int32 0 <= i < 2^23 (0x4B000000 is 2^23's bit pattern)."""
    return (i | 0x4B000000).to(tl.float32, bitcast=True)


def grouping(group: int, k: int, bits: int, block_k: int) -> str:
    """How scales vary inside a K tile: "tile" (one group per tile), "word" (per word row) or "row"."""
    if group >= k or group % block_k == 0:
        return "tile"
    return "word" if group % (32 // bits) == 0 else "row"


@triton.jit
def load_word_tile(qweight_ptr, offs_kw, mask_kw, offs_n, mask_n, stride_qw_k, stride_qw_n):
    """The packed words of word rows `offs_kw` and columns `offs_n` as [1, KW, BLOCK_N], loaded 3-D so that
    `dequant_words` keeps the load's vectorized layout."""
    rows = offs_kw.to(tl.int64)[None, :, None] * stride_qw_k
    ptrs = qweight_ptr + rows + offs_n.to(tl.int64)[None, None, :] * stride_qw_n
    return tl.load(ptrs, mask=mask_kw[None, :, None] & mask_n[None, None, :], other=0)


@triton.jit
def load_word_rows(
    qweight_ptr, k0, k_end, offs_n64, mask_n, stride_qw_k, stride_qw_n, PACK: tl.constexpr, KW: tl.constexpr
):
    """The [KW, BLOCK_N] packed words of the K tile at k0 (zeros where k0 >= k_end), for the GEMVs."""
    offs_kw = k0 // PACK + tl.arange(0, KW)
    mask = (offs_kw < k_end // PACK)[:, None] & mask_n[None, :]
    ptrs = qweight_ptr + offs_kw.to(tl.int64)[:, None] * stride_qw_k + offs_n64[None, :] * stride_qw_n
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def dequant_words(
    words,
    offs_kw,
    mask_kw,
    offs_n,
    mask_n,
    k0,
    K,
    qzeros_ptr,
    scales_ptr,
    stride_qz_g,
    stride_qz_n,
    stride_s_g,
    stride_s_n,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """fp32 W^T values of the K tile at k0 from its packed words [1, KW, BLOCK_N] (word rows `offs_kw`), as
    [PACK, KW, BLOCK_N]: value p of word row r is K row offs_kw[r] * PACK + p. Every value of a word comes out in
    the word's own registers, so the tile keeps the load's vectorized layout. `GROUPS` comes from `grouping`."""
    PACK: tl.constexpr = 32 // BITS
    # Value p is read in place within its 16-bit half: it sits at bit `pos` of word >> (16 * (p // HALF)). Per
    # value p, as [PACK, 1, 1] constants folded per register.
    HALF: tl.constexpr = PACK // 2
    p = tl.arange(0, PACK)[:, None, None]
    hi = (p >= HALF).to(tl.int32)
    pos = (p % HALF) * BITS
    field = (((1 << BITS) - 1) << pos) | 0x4B000000
    unscale = ((127 - pos) << 23).to(tl.float32, bitcast=True)  # 2^-pos
    if GROUPS == "tile":
        z, s = group_params(
            qzeros_ptr, scales_ptr, k0 // GROUP_SIZE, mask_n, offs_n, stride_qz_g, stride_qz_n, stride_s_g,
            stride_s_n, BITS, ZERO_OFFSET,
        )  # fmt: skip
        z = z[None, None, :]
        s = s[None, None, :]
    elif GROUPS == "word":
        z, s = group_params(
            qzeros_ptr, scales_ptr, (offs_kw * PACK // GROUP_SIZE)[None, :, None],
            (mask_kw[:, None] & mask_n[None, :])[None, :, :], offs_n[None, None, :], stride_qz_g, stride_qz_n,
            stride_s_g, stride_s_n, BITS, ZERO_OFFSET,
        )  # fmt: skip
    else:  # groups narrower than a word: scales per K row
        k3 = (offs_kw * PACK)[None, :, None] + p
        z, s = group_params(
            qzeros_ptr, scales_ptr, k3 // GROUP_SIZE, (k3 < K) & mask_n[None, None, :], offs_n[None, None, :],
            stride_qz_g, stride_qz_n, stride_s_g, stride_s_n, BITS, ZERO_OFFSET,
        )  # fmt: skip
    v = (((words >> (16 * hi)) | 0x4B000000) & field).to(tl.float32, bitcast=True)  # 2^23 + q * 2^pos
    return (v - magic(z << pos)) * (s * unscale)


@triton.jit
def _write(acc, offs_m, offs_n, mask, N, bias_ptr, out_ptr, stride_out_m, stride_out_n, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out_m + offs_n.to(tl.int64)[None, :] * stride_out_n
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_output(
    acc,
    offs_m,
    offs_n,
    tile,
    pid_s,
    M,
    N,
    split_k,
    stride_p_s,
    bias_ptr,
    out_ptr,
    partial_ptr,
    lock_ptr,
    stride_out_m,
    stride_out_n,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """y[offs_m, offs_n] = acc (+ bias), or, when SPLIT, this program's share of the split-K reduction above."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        # partial [split_k, M, N] fp32, contiguous (stride_p_s = M * N < 2^31: the launch keeps bigger outputs
        # unsplit), so element offsets within a split fit int32 and only the split's base pointer is 64-bit.
        offs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(partial_ptr + pid_s.to(tl.int64) * stride_p_s + offs, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = tl.zeros_like(acc)
            slab = partial_ptr
            for _ in range(0, split_k):
                total += tl.load(slab + offs, mask=mask, other=0.0, cache_modifier=".cg")
                slab += stride_p_s
            _write(total, offs_m, offs_n, mask, N, bias_ptr, out_ptr, stride_out_m, stride_out_n, HAS_BIAS)
            tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        _write(acc, offs_m, offs_n, mask, N, bias_ptr, out_ptr, stride_out_m, stride_out_n, HAS_BIAS)
