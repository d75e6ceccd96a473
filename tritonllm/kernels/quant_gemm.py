"""Fused W4A16 GEMM over GPTQ-packed weights: y[M, N] = x[M, K][:, perm] @ dequant(W)[K, N] (+ bias).

One layout for every format: GPTQ's (AWQ checkpoints are repacked into it once at load, tritonllm/quant/awq.py).
    qweight [K // (32 // bits), N] int32  packed along K: word (r, n) holds rows r*P .. r*P + P - 1 of column n,
                                          row r*P + p in bits p*bits .. (P = 32 // bits values per word)
    qzeros  [G, N // P] int32             packed along N the same way; z = field + zero_offset
    scales  [G, N]                        W^T[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]
A row of words is contiguous along N, so a [BLOCK_K // P, BLOCK_N] tile of words is one coalesced load per row.

Three paths; quant_gemm_config.py picks one from M (with every launch heuristic):
  * GEMVs (decode rows), CUDA cores: for fp16 activations, 4-bit weights and fp16 scales `_quant_gemv_f16_kernel`
    (quant_gemv_f16.py) dequantizes two values per instruction and serves `block_m` rows per pass over the
    weights; otherwise `_quant_gemv_kernel` (quant_gemv.py), fp32 FMAs, one activation row per program.
  * `_quant_gemm_kernel` (here): each K tile of weights is dequantized in registers to fp32 ((q - z) * s, exact
    up to one rounding, see quant_gemm_common.py), rounded once to x's dtype and fed to tl.dot with an fp32
    accumulator. Every value of a word is produced in the word's own registers, so putting the tile's B rows back
    in K order permutes each thread's registers, and x's tile is used as loaded. (Rows ordered value-major, with
    x's tile permuted to match, took up to 22% more instructions per packed word on sm_90 and ran 2-20% slower on
    the H200 at 4-128 rows: docs/benchmarks.md.)
    With `swap_ab` it computes y^T = W^T x^T instead: the dequantized tile is the MMA's A operand, which Hopper's
    wgmma reads from registers, so one MMA stays in flight while the next tile is dequantized (unswapped, the tile
    is stored to shared memory for wgmma's B operand and each MMA is waited for before the next tile). The A
    operand's register layout costs a shared-memory exchange per tile, so it wins where the MMAs are long: on the
    H200 gate_up at 33-256 rows (1.05-1.21x), qkv at 33-128 and down at 65-128 (1.15-1.23x); see the table.
  * many rows (quant_dense.py): the weights dequantized to a dense W^T in x's dtype, then one cuBLAS matmul.
The two kernels split K when the (M, N) tiles alone cannot fill the GPU, the splits reduced inside the same launch
by the last program of each tile (quant_gemm_common.py): deterministic, no second kernel.
"""

import torch
import triton
import triton.language as tl

from tritonllm.kernels.arrival_counters import arrival_counters
from tritonllm.kernels.dependent_launch import dependent_launch, wait_for_previous_kernel
from tritonllm.kernels.quant_dense import dequantized_matmul
from tritonllm.kernels.quant_dequant import gptq_dequantize_ref
from tritonllm.kernels.quant_gemm_common import dequant_words, grouping, load_word_tile, store_output
from tritonllm.kernels.quant_gemm_config import QuantGemmConfig, check_config, num_sms, quant_gemm_config
from tritonllm.kernels.quant_gemv import _quant_gemv_kernel
from tritonllm.kernels.quant_gemv_f16 import _quant_gemv_f16_kernel, paired_gemv_applies
from tritonllm.platform import INTERPRET, check_kernel_device

FUSED_GPTQ_BITS = (2, 4, 8)


@triton.jit(do_not_specialize=["M"])  # rows vary per step: one variant for all (see paged_attention.py)
def _quant_gemm_kernel(
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
    GROUPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    PACK: tl.constexpr = 32 // BITS
    KW: tl.constexpr = BLOCK_K // PACK
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_m64 = offs_m.to(tl.int64)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_kw = k0 // PACK + tl.arange(0, KW)
        mask_kw = offs_kw < K // PACK
        words = load_word_tile(qweight_ptr, offs_kw, mask_kw, offs_n, mask_n, stride_qw_k, stride_qw_n)
        # [PACK, KW, BLOCK_N] -> [KW, PACK, BLOCK_N] (a permutation of each thread's registers) -> B rows in K order.
        w = dequant_words(
            words, offs_kw, mask_kw, offs_n, mask_n, k0, K, qzeros_ptr, scales_ptr, stride_qz_g, stride_qz_n,
            stride_s_g, stride_s_n, BITS, GROUP_SIZE, ZERO_OFFSET, GROUPS,
        )  # fmt: skip
        if SWAP_AB:
            w = tl.reshape(tl.permute(w, (2, 1, 0)), (BLOCK_N, BLOCK_K))
        else:
            w = tl.reshape(tl.permute(w, (1, 0, 2)), (BLOCK_K, BLOCK_N))
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m64[:, None] * stride_x_m + offs_k.to(tl.int64)[None, :] * stride_x_k,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        a = x
        b = w.to(x.dtype)
        if INTERPRET:
            if x.dtype == tl.bfloat16:
                # bf16 tl.dot is wrong under the interpreter; fp32 operands compute the same product.
                a = x.to(tl.float32)
                b = w
        if SWAP_AB:
            acc = tl.dot(b, tl.trans(a), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if SWAP_AB:
        acc = tl.trans(acc)

    store_output(
        acc, offs_m, offs_n, pid_m * tl.num_programs(1) + pid_n, pid_s, M, N, split_k, stride_p_s, bias_ptr, out_ptr,
        partial_ptr, lock_ptr, stride_out_m, stride_out_n, HAS_BIAS, SPLIT,
    )  # fmt: skip


def _launch(x, qweight, qzeros, scales, perm, bias, n, bits, group_size, zero_offset, config) -> torch.Tensor:
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
    if m == 0:
        return x.new_empty(*lead, n)
    group = k if group_size == -1 else group_size
    pairable = paired_gemv_applies(x.dtype, scales.dtype, bits, group, k)
    cfg = config or quant_gemm_config(m, n, k, bits, num_sms(x.device.index or 0), paired=pairable)
    check_config(cfg, bits)
    if cfg.dequant:
        return dequantized_matmul(x2, qweight, qzeros, scales, perm, bias, bits, group, zero_offset, cfg).reshape(
            *lead, n
        )
    if perm is not None:
        # Act-order: one gather of x's columns up front. Gathered inside the kernels, x was read element by element
        # (H200: 1.3-1.6x the plain time at one row, 3-15x from 16 rows; docs/benchmarks.md).
        x2 = x2.index_select(1, perm)
    paired = cfg.gemv and pairable
    if paired and (x2.stride(1) != 1 or x2.stride(0) % 2 or x2.data_ptr() % 4):
        x2 = x2.clone(memory_format=torch.contiguous_format)  # read as int32 words of two fp16 values
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = cfg.split_k if m * n < 2**31 else 1  # split-K offsets within a split are int32
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty splits
    m_tiles = m if cfg.gemv and not paired else triton.cdiv(m, cfg.block_m)
    grid = (m_tiles, triton.cdiv(n, cfg.block_n), split_k)
    if split_k > 1:
        partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)  # [SPLIT_K, M, N]
        locks = arrival_counters(x.device, grid[0] * grid[1])
    else:
        partial = locks = out  # unused pointers
    args = (
        x2,
        qweight,
        qzeros,
        scales,
        bias if bias is not None else scales,  # unused pointer when HAS_BIAS is False
        out,
        partial,
        locks,
        m,
        n,
        k,
        k_per_split,
        split_k,
        m * n,
        x2.stride(0),
        x2.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        qzeros.stride(0),
        qzeros.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        out.stride(1),
    )
    common = dict(
        GROUP_SIZE=group,
        ZERO_OFFSET=zero_offset,
        GROUPS=grouping(group, k, bits, cfg.block_k),
        HAS_BIAS=bias is not None,
        SPLIT=split_k > 1,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **dependent_launch(x.device),
    )
    if paired:
        _quant_gemv_f16_kernel[grid](
            *args, PREFETCH=cfg.num_stages > 1, BLOCK_M=cfg.block_m, INTERPRET=INTERPRET, **common
        )  # fmt: skip
    elif cfg.gemv:
        _quant_gemv_kernel[grid](*args, BITS=bits, PREFETCH=cfg.num_stages > 1, **common)
    else:
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        _quant_gemm_kernel[grid](
            *args, BITS=bits, DOT_PRECISION=precision, INTERPRET=INTERPRET, BLOCK_M=cfg.block_m, SWAP_AB=cfg.swap_ab,
            **common,
        )  # fmt: skip
    return out.reshape(*lead, n)


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
    """y [..., N] = x[..., perm] @ W^T + bias with W^T[i, n] = (q[i, n] - z[i // g, n]) * s[i // g, n].

    Groups are the regular runs of g rows (an act-order checkpoint is permuted into that shape at load time and
    passes the permutation as `perm` [K] int32; None means the identity). z = stored field + zero_offset
    (1 for checkpoint_format "gptq", 0 for "gptq_v2" and for repacked AWQ). bits 2, 4 or 8 (3-bit goes through
    `gptq_dequantize`). x is float16, bfloat16 or float32; accumulation is fp32; y has x's dtype. `config`
    overrides the launch heuristics (quant_gemm_config.py).
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
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32:
            raise ValueError(f"GPTQ {name} must be int32 packed words, got {t.dtype}")
    expect = ((k // pack, n), (groups, n // pack), (groups, n))
    got = (tuple(qweight.shape), tuple(qzeros.shape), tuple(scales.shape))
    if k % pack or got != expect:
        raise ValueError(
            f"GPTQ shapes (qweight, qzeros, scales) must be {expect} for K={k} (a multiple of {pack}), N={n} and "
            f"group size {group_size}, got {got}"
        )
    if perm is not None and (perm.shape != (k,) or perm.dtype != torch.int32 or not perm.is_contiguous()):
        raise ValueError(
            f"perm must be a contiguous int32 tensor of shape [K={k}], got {perm.dtype} {tuple(perm.shape)}"
        )
    return _launch(x, qweight, qzeros, scales, perm, bias, n, bits, group_size, zero_offset, config)


def gptq_gemm_ref(
    x, qweight, qzeros, scales, bits: int, group_size: int, zero_offset: int = 1, perm=None, bias=None
) -> torch.Tensor:
    """Float32 x[..., perm] @ dequant(W) (+ bias) for GPTQ tensors with regular groups."""
    w = gptq_dequantize_ref(qweight, qzeros, scales, None, bits, group_size, zero_offset)
    xs = x.float() if perm is None else x.float()[..., perm.long()]
    y = xs @ w
    return y if bias is None else y + bias.float()
