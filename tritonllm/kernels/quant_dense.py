"""The many-rows path of the quantized GEMM: dequantize the packed weights to a dense W^T once per call, then one
cuBLAS matmul (launched by `gptq_gemm` in quant_gemm.py when its config says `dequant`).

Past one 128-row MMA tile (`DEQUANT_MIN_M`) the product is compute bound, and the fused tl.dot kernel, which
dequantizes every tile in registers before each MMA, runs at well under half the dense matmul's rate. Writing W^T
[K, N] in x's dtype costs one pass over K * N elements, independent of M, so past the crossover the dense matmul's
speed wins (vLLM's AWQ layer makes the same switch at 256 tokens).

The write runs at copy speed (2.8 TB/s on the H100, 14.5-18.6% of an AWQ offline step's GPU time). Two ways
around it lost on the H100 (docs/benchmarks.md, twenty-seventh pass): writing and multiplying W^T in column
chunks that stay in L2 (slower at 256-1,024 rows on every projection), and writing the next layer's W^T on a side
stream during this layer's matmul (the two share the SMs and DRAM: the step took 2.7% longer).

An act-order permutation is folded into the rows written: packed row i multiplies x[:, perm[i]], so it is stored
as row perm[i] and the matmul takes x as it is.
"""

import torch
import triton
import triton.language as tl

from tritonllm.kernels.quant_gemm_common import dequant_words, grouping, load_word_tile


@triton.jit
def _dense_weight_kernel(
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    perm_ptr,
    out_ptr,
    N,
    K,
    stride_qw_k,
    stride_qw_n,
    stride_qz_g,
    stride_qz_n,
    stride_s_g,
    stride_s_n,
    stride_out_k,
    stride_out_n,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    GROUPS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    KW: tl.constexpr = BLOCK_K // PACK
    k0 = tl.program_id(0) * BLOCK_K
    offs_kw = k0 // PACK + tl.arange(0, KW)
    mask_kw = offs_kw < K // PACK
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    words = load_word_tile(qweight_ptr, offs_kw, mask_kw, offs_n, mask_n, stride_qw_k, stride_qw_n)
    w = dequant_words(
        words, offs_kw, mask_kw, offs_n, mask_n, k0, K, qzeros_ptr, scales_ptr, stride_qz_g, stride_qz_n, stride_s_g,
        stride_s_n, BITS, GROUP_SIZE, ZERO_OFFSET, GROUPS,
    )  # fmt: skip
    rows = (offs_kw * PACK)[None, :, None] + tl.arange(0, PACK)[:, None, None]  # [PACK, KW, 1], as w's values
    if HAS_PERM:
        rows = tl.load(perm_ptr + rows, mask=mask_kw[None, :, None], other=0)
    ptrs = out_ptr + rows.to(tl.int64) * stride_out_k + offs_n.to(tl.int64)[None, None, :] * stride_out_n
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=mask_kw[None, :, None] & mask_n[None, None, :])


def dense_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    perm: torch.Tensor | None,
    bits: int,
    group: int,
    zero_offset: int,
    dtype: torch.dtype,
    block_n: int,
    block_k: int,
    num_warps: int,
) -> torch.Tensor:
    """W^T [K, N] in `dtype`, with row perm[i] holding packed row i (row i without `perm`); `group` is the group
    size in rows (K for a single group). Shapes are checked by `gptq_gemm`."""
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _dense_weight_kernel[grid](
        qweight,
        qzeros,
        scales,
        perm if perm is not None else qweight,  # unused pointer when HAS_PERM is False
        out,
        n,
        k,
        qweight.stride(0),
        qweight.stride(1),
        qzeros.stride(0),
        qzeros.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        out.stride(1),
        BITS=bits,
        GROUP_SIZE=group,
        ZERO_OFFSET=zero_offset,
        GROUPS=grouping(group, k, bits, block_k),
        HAS_PERM=perm is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return out


def dequantized_matmul(x2, qweight, qzeros, scales, perm, bias, bits, group, zero_offset, config) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ dense_weight(...) (+ bias) with the dense weight's tile from `config`."""
    w = dense_weight(
        qweight, qzeros, scales, perm, bits, group, zero_offset, x2.dtype, config.block_n, config.block_k,
        config.num_warps,
    )  # fmt: skip
    return torch.mm(x2, w) if bias is None else torch.addmm(bias.to(x2.dtype), x2, w)
