"""Fused W4A16 GEMM over packed AWQ / GPTQ weights: y[M, N] = x[M, K] @ dequant(W)[K, N] (+ bias).

The kernel reads the packed int32 words of each [BLOCK_K, BLOCK_N] tile, dequantizes them in registers
((q - z) * s in fp32), casts to the activation dtype and feeds tl.dot with an fp32 accumulator. One kernel, two
regimes picked by `quant_gemm_config` (quant_gemm_config.py, every launch heuristic) from M:
  * small M (decode): split-K, so that a batch of one still spreads over every SM; partial sums go to an fp32
    workspace [SPLIT_K, M, N] reduced (plus bias) by a second small kernel;
  * large M (prefill): no split, wider M tiles, bias fused into the epilogue.

Layouts (g = group size, K = input features, N = output features):
    AWQ   qweight [K, N // 8] int32, packed along N in nibble order 0 2 4 6 1 3 5 7; qzeros [K // g, N // 8] int32
          (same order); scales [K // g, N]
    GPTQ  qweight [K // (32 // bits), N] int32, packed along K; qzeros [G, N // (32 // bits)] int32, packed along N;
          scales [G, N]; bits 2, 4 or 8. Row i of qweight belongs to group i // g; with act-order the rows were
          permuted at load time so that holds, and `perm` [K] maps row i back to its input feature (x[:, perm[i]]).
"""

import torch
import triton
import triton.language as tl

from tritonllm.kernels.quant_dequant import awq_dequantize_ref, gptq_dequantize_ref
from tritonllm.kernels.quant_gemm_config import QuantGemmConfig, num_sms, quant_gemm_config
from tritonllm.platform import INTERPRET, check_kernel_device

FUSED_GPTQ_BITS = (2, 4, 8)


@triton.jit
def _quant_gemm_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    perm_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_x_m,
    stride_x_k,
    stride_qw_0,
    stride_qw_1,
    stride_qz_0,
    stride_qz_1,
    stride_s_g,
    stride_s_n,
    stride_out_s,
    stride_out_m,
    stride_out_n,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    AWQ: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    TILE_IN_ONE_GROUP: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_m64 = offs_m.to(tl.int64)
    offs_n64 = offs_n.to(tl.int64)

    # Where column n sits inside a word packed along N (all qzeros, and AWQ's qweight).
    if AWQ:
        j = offs_n % 8
        col_shift = ((j // 2) + (j % 2) * 4) * 4  # AWQ nibble of column 8c + j
    else:
        col_shift = (offs_n % PACK) * BITS
    col_word = offs_n64 // PACK

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        offs_k64 = offs_k.to(tl.int64)
        if HAS_PERM:
            x_cols = tl.load(perm_ptr + offs_k64, mask=mask_k, other=0).to(tl.int64)
        else:
            x_cols = offs_k64
        x = tl.load(
            x_ptr + offs_m64[:, None] * stride_x_m + x_cols[None, :] * stride_x_k,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )

        w_mask = mask_k[:, None] & mask_n[None, :]
        if AWQ:
            words = tl.load(
                qweight_ptr + offs_k64[:, None] * stride_qw_0 + col_word[None, :] * stride_qw_1, mask=w_mask, other=0
            )
            q = (words >> col_shift[None, :]) & MASK
        else:
            words = tl.load(
                qweight_ptr + (offs_k64 // PACK)[:, None] * stride_qw_0 + offs_n64[None, :] * stride_qw_1,
                mask=w_mask,
                other=0,
            )
            q = (words >> ((offs_k % PACK) * BITS)[:, None]) & MASK

        if TILE_IN_ONE_GROUP:
            group = k0 // GROUP_SIZE
            zwords = tl.load(qzeros_ptr + group * stride_qz_0 + col_word * stride_qz_1, mask=mask_n, other=0)
            z = ((zwords >> col_shift) & MASK) + ZERO_OFFSET
            s = tl.load(scales_ptr + group * stride_s_g + offs_n64 * stride_s_n, mask=mask_n, other=0.0)
            w = (q - z[None, :]).to(tl.float32) * s.to(tl.float32)[None, :]
        else:
            group = (offs_k64 // GROUP_SIZE)[:, None]
            zwords = tl.load(qzeros_ptr + group * stride_qz_0 + col_word[None, :] * stride_qz_1, mask=w_mask, other=0)
            z = ((zwords >> col_shift[None, :]) & MASK) + ZERO_OFFSET
            s = tl.load(scales_ptr + group * stride_s_g + offs_n64[None, :] * stride_s_n, mask=w_mask, other=0.0)
            w = (q - z).to(tl.float32) * s.to(tl.float32)

        a = x
        b = w.to(x.dtype)
        if INTERPRET:
            if x.dtype == tl.bfloat16:
                # bf16 tl.dot is wrong under the interpreter; fp32 operands compute the same product.
                a = x.to(tl.float32)
                b = w
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

    out_mask = mask_m[:, None] & mask_n[None, :]
    if WRITE_PARTIAL:
        out_ptrs = out_ptr + pid_s * stride_out_s + offs_m64[:, None] * stride_out_m + offs_n64[None, :] * stride_out_n
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n64, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m64[:, None] * stride_out_m + offs_n64[None, :] * stride_out_n
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    N,
    split_k,
    stride_p_s,
    stride_p_m,
    stride_out_m,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(0, split_k):
        acc += tl.load(partial_ptr + s * stride_p_s + row * stride_p_m + offs_n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out_m + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, qweight, qzeros, scales, perm, bias, n, bits, group_size, awq, zero_offset, config) -> torch.Tensor:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"activations must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., K] with K > 0, got {tuple(x.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [N={n}] tensor, got {tuple(bias.shape)}")
    check_kernel_device(x, qweight, qzeros, scales)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    group = k if group_size == -1 else group_size
    cfg = config or quant_gemm_config(m, n, k, group_size, num_sms(x.device.index or 0))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty splits
    # Split-K programs write fp32 partial sums [SPLIT_K, M, N]; unsplit ones write y directly.
    target = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
    _quant_gemm_kernel[grid](
        x2,
        qweight,
        qzeros,
        scales,
        perm if perm is not None else qweight,  # unused pointer when HAS_PERM is False
        bias if bias is not None else scales,  # unused pointer when HAS_BIAS is False
        target,
        m,
        n,
        k,
        k_per_split,
        x2.stride(0),
        x2.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        qzeros.stride(0),
        qzeros.stride(1),
        scales.stride(0),
        scales.stride(1),
        target.stride(0) if split_k > 1 else 0,
        target.stride(-2),
        target.stride(-1),
        BITS=bits,
        GROUP_SIZE=group,
        AWQ=awq,
        ZERO_OFFSET=zero_offset,
        TILE_IN_ONE_GROUP=group >= k or group % cfg.block_k == 0,
        HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None,
        WRITE_PARTIAL=split_k > 1,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        INTERPRET=INTERPRET,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split_k > 1:
        block_n = 256
        _split_k_reduce_kernel[(m, triton.cdiv(n, block_n))](
            target,
            bias if bias is not None else target,
            out,
            n,
            split_k,
            target.stride(0),
            target.stride(1),
            out.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_N=block_n,
        )
    return out.reshape(*lead, n)


def _check_packed(qweight, qzeros, scales, expect_qw, expect_qz, expect_s, fmt) -> None:
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32:
            raise ValueError(f"{fmt} {name} must be int32 packed words, got {t.dtype}")
    got = (tuple(qweight.shape), tuple(qzeros.shape), tuple(scales.shape))
    if got != (expect_qw, expect_qz, expect_s):
        raise ValueError(
            f"{fmt} shapes (qweight, qzeros, scales) must be {(expect_qw, expect_qz, expect_s)} for these K, N and "
            f"group size, got {got}"
        )


def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: QuantGemmConfig | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T + bias with W^T[k, n] = (q - z[k // g, n]) * s[k // g, n] (AWQ, 4-bit).

    x is float16, bfloat16 or float32; accumulation is fp32; y has x's dtype.
    """
    # x [..., K] · qweight [K, N // 8] int32 · qzeros [K // g, N // 8] int32 · scales [K // g, N] · bias [N]
    k, n = x.shape[-1], qweight.shape[1] * 8
    g = k if group_size == -1 else group_size
    if g <= 0 or k % g:
        raise ValueError(f"AWQ group_size {group_size} must be -1 or a positive divisor of the input size {k}")
    _check_packed(qweight, qzeros, scales, (k, n // 8), (k // g, n // 8), (k // g, n), "AWQ")
    return _launch(x, qweight, qzeros, scales, None, bias, n, 4, group_size, True, 0, config)


def gptq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    group_size: int,
    zero_offset: int = 1,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: QuantGemmConfig | None = None,
) -> torch.Tensor:
    """y [..., N] = x[..., perm] @ W^T + bias with W^T[i, n] = (q[i, n] - z[i // g, n]) * s[i // g, n] (GPTQ).

    Groups are the regular runs of g rows (an act-order checkpoint is permuted into that shape at load time and
    passes the permutation as `perm` [K] int32; None means the identity). z = stored field + zero_offset
    (1 for checkpoint_format "gptq", 0 for "gptq_v2"). bits 2, 4 or 8; 3-bit goes through `gptq_dequantize`.
    """
    # x [..., K] · qweight [K // (32 // bits), N] int32 · qzeros [G, N // (32 // bits)] int32 · scales [G, N]
    if bits not in FUSED_GPTQ_BITS:
        raise ValueError(f"the fused GPTQ GEMM takes bits in {list(FUSED_GPTQ_BITS)}, got {bits}; dequantize instead")
    pack = 32 // bits
    k, n = x.shape[-1], qweight.shape[1]
    g = k if group_size == -1 else group_size
    if g <= 0:
        raise ValueError(f"GPTQ group_size must be -1 or positive, got {group_size}")
    groups = triton.cdiv(k, g)
    _check_packed(qweight, qzeros, scales, (k // pack, n), (groups, n // pack), (groups, n), "GPTQ")
    if perm is not None and (perm.shape != (k,) or perm.dtype != torch.int32 or not perm.is_contiguous()):
        raise ValueError(
            f"perm must be a contiguous int32 tensor of shape [K={k}], got {perm.dtype} {tuple(perm.shape)}"
        )
    return _launch(x, qweight, qzeros, scales, perm, bias, n, bits, group_size, False, zero_offset, config)


def awq_gemm_ref(x, qweight, qzeros, scales, group_size: int, bias=None) -> torch.Tensor:
    """Float32 x @ dequant(W) (+ bias) for AWQ tensors."""
    y = x.float() @ awq_dequantize_ref(qweight, qzeros, scales, group_size)
    return y if bias is None else y + bias.float()


def gptq_gemm_ref(
    x, qweight, qzeros, scales, bits: int, group_size: int, zero_offset: int = 1, perm=None, bias=None
) -> torch.Tensor:
    """Float32 x[..., perm] @ dequant(W) (+ bias) for GPTQ tensors with regular groups."""
    w = gptq_dequantize_ref(qweight, qzeros, scales, None, bits, group_size, zero_offset)
    xs = x.float() if perm is None else x.float()[..., perm.long()]
    y = xs @ w
    return y if bias is None else y + bias.float()
