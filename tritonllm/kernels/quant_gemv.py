"""The GEMV kernel of the fused quantized GEMM (decode rows; launched by `gptq_gemm` in quant_gemm.py).

One activation row per program, CUDA-core FMAs, split-K across programs: the launch is bound by streaming the
packed weights, so what counts is few instructions per weight and enough programs in flight. Per word row the
kernel sums (q - z) * x over the word's values and multiplies by the scale once, with scales and zeros loaded
once per K tile (one group) as [BLOCK_N] vectors. Rows of a batch > 1 re-read the weights, mostly from L2.
"""

import triton
import triton.language as tl

from tritonllm.kernels.dependent_launch import wait_for_previous_kernel
from tritonllm.kernels.quant_gemm_common import group_params, load_word_rows, magic, store_output


@triton.jit(do_not_specialize=["M"])  # rows vary per step: one variant for all (see paged_attention.py)
def _quant_gemv_kernel(
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
    stride_x_m,
    stride_x_k,
    stride_qw_k,
    stride_qw_n,
    stride_qz_g,
    stride_qz_n,
    stride_s_g,
    stride_s_n,
    stride_out_m,
    stride_out_n,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    GROUPS: tl.constexpr,  # "tile": one group per K tile, "word": per word row, "row": per K row
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    KW: tl.constexpr = BLOCK_K // PACK  # word rows per tile
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_n64 = offs_n.to(tl.int64)
    x_row = x_ptr + row.to(tl.int64) * stride_x_m

    # acc[r, n]: this program's share of y[row, n] from word rows r of every tile, reduced over r at the end.
    acc = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # PREFETCH: each tile's words (and, one group per tile, its scales and zeros) are loaded one iteration ahead,
    # so their latency overlaps the previous tile's math (more registers per program); nothing past this split's
    # K range is read.
    if PREFETCH:
        words = load_word_rows(qweight_ptr, k_start, k_end, offs_n64, mask_n, stride_qw_k, stride_qw_n, PACK, KW)
        if GROUPS == "tile":
            z, s = group_params(
                qzeros_ptr, scales_ptr, k_start // GROUP_SIZE, mask_n & (offs_n * 0 + k_start < k_end), offs_n,
                stride_qz_g, stride_qz_n, stride_s_g, stride_s_n, BITS, ZERO_OFFSET,
            )  # fmt: skip
    # Weights, scales and zeros are no earlier kernel's output: the first tile is in flight while it drains.
    wait_for_previous_kernel(PDL)
    for k0 in range(k_start, k_end, BLOCK_K):
        k1 = k0 + BLOCK_K
        if PREFETCH:
            cur = words
            words = load_word_rows(qweight_ptr, k1, k_end, offs_n64, mask_n, stride_qw_k, stride_qw_n, PACK, KW)
        else:
            cur = load_word_rows(qweight_ptr, k0, k_end, offs_n64, mask_n, stride_qw_k, stride_qw_n, PACK, KW)
        offs_kw = k0 // PACK + tl.arange(0, KW)
        mask_kw = offs_kw < K // PACK
        # Scales and zeros as [1, BLOCK_N] (one group per tile) or [KW, BLOCK_N] (per word row); 1-D loads
        # broadcast, so the [KW, BLOCK_N] math stays in the words' register layout.
        if GROUPS == "tile":
            if PREFETCH:
                zw = z[None, :]
                sw = s[None, :]
                # (offs_n * 0 + k1: a tensor comparison; the interpreter rejects a mask ANDed with a scalar one)
                z, s = group_params(
                    qzeros_ptr, scales_ptr, k1 // GROUP_SIZE, mask_n & (offs_n * 0 + k1 < k_end), offs_n,
                    stride_qz_g, stride_qz_n, stride_s_g, stride_s_n, BITS, ZERO_OFFSET,
                )  # fmt: skip
            else:
                zt, st = group_params(
                    qzeros_ptr, scales_ptr, k0 // GROUP_SIZE, mask_n, offs_n, stride_qz_g, stride_qz_n, stride_s_g,
                    stride_s_n, BITS, ZERO_OFFSET,
                )  # fmt: skip
                zw = zt[None, :]
                sw = st[None, :]
        elif GROUPS == "word":
            zw, sw = group_params(
                qzeros_ptr, scales_ptr, (offs_kw * PACK // GROUP_SIZE)[:, None], mask_kw[:, None] & mask_n[None, :],
                offs_n[None, :], stride_qz_g, stride_qz_n, stride_s_g, stride_s_n, BITS, ZERO_OFFSET,
            )  # fmt: skip
        # t[r, n] = sum over the word's values p of (q - z) * x[k0 + r * PACK + p]. A value is masked in place, not
        # shifted down: within a 16-bit half its field at bit `pos` reads as 2^23 + q * 2^pos, so one LOP3 per
        # value; the zero is scaled the same way and x by 2^-pos (exact powers of two) to compensate.
        t = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
        for h in tl.static_range(2):
            half = (cur >> 16 if h == 1 else cur) | 0x4B000000
            for j in tl.static_range(PACK // 2):
                p = h * (PACK // 2) + j
                pos = j * BITS
                k = offs_kw * PACK + p
                xp = tl.load(x_row + k.to(tl.int64) * stride_x_k, mask=mask_kw, other=0.0).to(tl.float32)
                v = (half & ((((1 << BITS) - 1) << pos) | 0x4B000000)).to(tl.float32, bitcast=True)
                if GROUPS == "row":  # groups narrower than a word: scales per K row
                    zr, sr = group_params(
                        qzeros_ptr, scales_ptr, ((offs_kw * PACK + p) // GROUP_SIZE)[:, None],
                        mask_kw[:, None] & mask_n[None, :], offs_n[None, :], stride_qz_g, stride_qz_n, stride_s_g,
                        stride_s_n, BITS, ZERO_OFFSET,
                    )  # fmt: skip
                    t += (v - magic(zr << pos)) * sr * (xp * (1.0 / (1 << pos)))[:, None]
                else:
                    t += (v - magic(zw << pos)) * (xp * (1.0 / (1 << pos)))[:, None]
        if GROUPS == "row":
            acc += t
        else:
            acc += t * sw

    y = tl.sum(acc, axis=0)
    store_output(
        y[None, :], row + tl.arange(0, 1), offs_n, row * tl.num_programs(1) + pid_n, pid_s, M, N, split_k,
        stride_p_s, bias_ptr, out_ptr, partial_ptr, lock_ptr, stride_out_m, stride_out_n, HAS_BIAS, SPLIT,
    )  # fmt: skip
