"""Dequantize AWQ / GPTQ packed weights to a dense W^T [K, N], reading the checkpoint layouts directly.

Used where the fused GEMM does not apply (3-bit GPTQ, act-order groups that are not a permutation of regular
groups) and as a check of the formats. Layouts (K = input features, N = output features, g = group size):

    AWQ   qweight [K, N // 8] int32 (packed along N, nibble order 0 2 4 6 1 3 5 7), qzeros [K // g, N // 8] int32
          (same order), scales [K // g, N];                       w[k, n] = (q - z[k // g, n]) * s[k // g, n]
    GPTQ  qweight [K * bits // 32, N] int32 (bit stream along K), qzeros [G, N * bits // 32] int32 (bit stream
          along N), scales [G, N], g_idx [K];                     w[k, n] = (q - z[g_idx[k], n]) * s[g_idx[k], n]
          with z = stored field + zero_offset (1 for checkpoint_format "gptq", 0 for "gptq_v2").
"""

import torch
import triton
import triton.language as tl

from tritonllm.platform import check_kernel_device

GPTQ_BITS = (2, 3, 4, 8)


@triton.jit
def _unpack_stream(ptr, index, other_offset, stride_packed, mask, BITS: tl.constexpr):
    """Values at positions `index` of int32 bit streams laid along the dimension with `stride_packed`.

    Works in int64 on zero-extended words so that a 3-bit value straddling two words is reassembled with logical
    shifts.
    """
    bit = index * BITS
    word = bit // 32
    shift = bit % 32
    lo = tl.load(ptr + word * stride_packed + other_offset, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
    value = lo >> shift
    if 32 % BITS != 0:
        spill = mask & (shift + BITS > 32)
        hi = tl.load(ptr + (word + 1) * stride_packed + other_offset, mask=spill, other=0).to(tl.int64) & 0xFFFFFFFF
        value = value | tl.where(spill, hi << (32 - shift), 0)
    return value & ((1 << BITS) - 1)


@triton.jit
def _dequant_kernel(
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    g_idx_ptr,
    out_ptr,
    K,
    N,
    stride_qw_0,
    stride_qw_1,
    stride_qz_0,
    stride_qz_1,
    stride_s_g,
    stride_s_n,
    stride_out_k,
    stride_out_n,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    AWQ: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_k = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_k = offs_k < K
    mask_n = offs_n < N
    mask = mask_k[:, None] & mask_n[None, :]

    if HAS_G_IDX:
        group = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0).to(tl.int64)
    else:
        group = offs_k // GROUP_SIZE

    if AWQ:
        # Column n sits in word n // 8 at nibble AWQ_UNPACK_ORDER[n % 8] = (n % 8) // 2 + 4 * (n % 2).
        j = offs_n % 8
        shift = ((j // 2) + (j % 2) * 4) * 4
        words = tl.load(
            qweight_ptr + offs_k[:, None] * stride_qw_0 + (offs_n // 8)[None, :] * stride_qw_1, mask=mask, other=0
        )
        q = (words >> shift[None, :]) & 0xF
        zwords = tl.load(
            qzeros_ptr + group[:, None] * stride_qz_0 + (offs_n // 8)[None, :] * stride_qz_1, mask=mask, other=0
        )
        z = (zwords >> shift[None, :]) & 0xF
    else:
        # qweight: bit stream along K (rows); qzeros: bit stream along N (columns).
        q = _unpack_stream(qweight_ptr, offs_k[:, None], offs_n[None, :] * stride_qw_1, stride_qw_0, mask, BITS)
        z = _unpack_stream(qzeros_ptr, offs_n[None, :], group[:, None] * stride_qz_0, stride_qz_1, mask, BITS)
        z = z + ZERO_OFFSET

    s = tl.load(scales_ptr + group[:, None] * stride_s_g + offs_n[None, :] * stride_s_n, mask=mask, other=0.0)
    w = (q - z).to(tl.float32) * s.to(tl.float32)
    out_ptrs = out_ptr + offs_k[:, None] * stride_out_k + offs_n[None, :] * stride_out_n
    tl.store(out_ptrs, w.to(out_ptr.dtype.element_ty), mask=mask)


def _check_int32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 (packed words as the checkpoint stores them), got {t.dtype}")


def _launch(qweight, qzeros, scales, g_idx, out, k, n, bits, group_size, awq, zero_offset) -> torch.Tensor:
    check_kernel_device(qweight, qzeros, scales, out)
    block_k, block_n = 32, 64
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _dequant_kernel[grid](
        qweight,
        qzeros,
        scales,
        g_idx if g_idx is not None else qweight,  # unused pointer when HAS_G_IDX is False
        out,
        k,
        n,
        qweight.stride(0),
        qweight.stride(1),
        qzeros.stride(0),
        qzeros.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        out.stride(1),
        BITS=bits,
        GROUP_SIZE=group_size,
        AWQ=awq,
        HAS_G_IDX=g_idx is not None,
        ZERO_OFFSET=zero_offset,
        BLOCK_K=block_k,
        BLOCK_N=block_n,
    )
    return out


def awq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Dense W^T [K, N] (dtype, default scales.dtype) from AutoAWQ GEMM tensors.

    w[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n], computed in fp32 and rounded once.
    """
    # qweight [K, N // 8] int32 · qzeros [K // g, N // 8] int32 · scales [K // g, N]
    _check_int32(qweight=qweight, qzeros=qzeros)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    g = k if group_size == -1 else group_size
    if g <= 0 or k % g:
        raise ValueError(f"AWQ group_size {group_size} must be -1 or a positive divisor of the input size {k}")
    if qzeros.shape != (k // g, n // 8) or scales.shape != (k // g, n):
        raise ValueError(
            f"AWQ shapes disagree: qweight {tuple(qweight.shape)} implies qzeros {(k // g, n // 8)} and scales "
            f"{(k // g, n)}, got {tuple(qzeros.shape)} and {tuple(scales.shape)}"
        )
    out = torch.empty(k, n, dtype=dtype or scales.dtype, device=qweight.device)
    return _launch(qweight, qzeros, scales, None, out, k, n, 4, g, True, 0)


def gptq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    zero_offset: int = 1,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Dense W^T [K, N] (dtype, default scales.dtype) from GPTQ tensors, any of 2, 3, 4, 8 bits.

    w[k, n] = (q[k, n] - z[grp, n]) * s[grp, n] with grp = g_idx[k] (or k // group_size when g_idx is None) and
    z = stored field + zero_offset (1 for checkpoint_format "gptq", 0 for "gptq_v2").
    """
    # qweight [K * bits // 32, N] int32 · qzeros [G, N * bits // 32] int32 · scales [G, N] · g_idx [K] int32
    if bits not in GPTQ_BITS:
        raise ValueError(f"GPTQ bits={bits} is not supported; supported: {list(GPTQ_BITS)}")
    _check_int32(qweight=qweight, qzeros=qzeros)
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    g = k if group_size == -1 else group_size
    num_groups = scales.shape[0]
    if g <= 0 or (g_idx is None and num_groups != -(-k // g)):
        raise ValueError(f"GPTQ group_size {group_size} does not match {num_groups} scale rows for K={k}")
    if qzeros.shape != (num_groups, n * bits // 32) or scales.shape != (num_groups, n):
        raise ValueError(
            f"GPTQ shapes disagree: qweight {tuple(qweight.shape)} implies qzeros {(num_groups, n * bits // 32)} "
            f"and scales {(num_groups, n)}, got {tuple(qzeros.shape)} and {tuple(scales.shape)}"
        )
    if g_idx is not None:
        if g_idx.shape != (k,) or g_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"g_idx must be an int32 tensor of shape [K={k}], got {g_idx.dtype} {tuple(g_idx.shape)}")
        g_idx = g_idx.contiguous()
    out = torch.empty(k, n, dtype=dtype or scales.dtype, device=qweight.device)
    return _launch(qweight, qzeros, scales, g_idx, out, k, n, bits, g, False, zero_offset)


def _unpack_stream_ref(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows of int32 words -> rows of values: value i is stream bits bits*i .. of the row's words (fp32-free)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    count = w.shape[-1] * 32 // bits
    values = []
    for i in range(count):
        v = 0
        for b in range(bits):
            bit = bits * i + b
            v = v | (((w[..., bit // 32] >> (bit % 32)) & 1) << b)
        values.append(v)
    return torch.stack(values, dim=-1)


def awq_dequantize_ref(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """Float32 W^T [K, N] from AWQ tensors, written from the format's definition."""
    k = qweight.shape[0]
    g = k if group_size == -1 else group_size
    order = [0, 4, 1, 5, 2, 6, 3, 7]  # column 8c + j is nibble order[j] of word c

    def columns(words):
        nibbles = _unpack_stream_ref(words, 4)  # [R, N] in nibble order per word
        r, n = nibbles.shape
        return nibbles.reshape(r, n // 8, 8)[:, :, order].reshape(r, n)

    q, z = columns(qweight), columns(qzeros)
    group = torch.arange(k, device=qweight.device) // g
    return (q - z[group]).float() * scales.float()[group]


def gptq_dequantize_ref(qweight, qzeros, scales, g_idx, bits: int, group_size: int, zero_offset: int = 1):
    """Float32 W^T [K, N] from GPTQ tensors, written from the format's definition."""
    q = _unpack_stream_ref(qweight.t(), bits).t()  # stream along K for each column
    z = _unpack_stream_ref(qzeros, bits) + zero_offset  # stream along N for each group
    k = q.shape[0]
    if g_idx is None:
        g = k if group_size == -1 else group_size
        g_idx = torch.arange(k, device=qweight.device) // g
    group = g_idx.long()
    return (q - z[group]).float() * scales.float()[group]
