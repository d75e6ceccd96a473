"""Dense GEMV for a few rows (decode): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp16 / bf16 / fp32, M <= 16.
With a gated activation it is the MLP's gate_up projection and its activation in one launch:
y[M, I] = act(x @ W[:I]^T) * (x @ W[I:]^T) for W = [gate; up] of 2I rows, no [M, 2I] intermediate.

At a few rows a linear layer reads every weight once and does two flops per weight read: it is bound by memory
bandwidth, and cuBLAS reaches only part of it there. Each program owns BLOCK_N weight rows (output columns) and
a run of K (split-K when the N tiles alone cannot fill the SMs), streams [BLOCK_N, BLOCK_K] weight tiles with
K contiguous (16-byte loads) and loads the matching x tile for all rows each iteration. fp32 accumulation, one
rounding to x's dtype on store. Two compute paths (dense_gemv_config.py chooses, and says why):
  * CUDA cores: acc[m, n, k] += w[n, k] * x[m, k] in a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 accumulator, reduced
    along K once after the loop, so a tile costs one FMA per weight and row and no cross-thread reduction. Both
    operands are loaded 3-D ([1, BLOCK_N, BLOCK_K] and [BLOCK_M, 1, BLOCK_K]) so that, with BLOCK_K spanning the
    CTA's loads (dense_gemv_config.k_span), they share the accumulator's register layout: rows and weight rows
    sit in each thread's registers and no tile goes through shared memory.
  * tl.dot: acc[n, m] = W tile @ x tile^T, the weight tile as the MMA's M side and the rows padded to 16 as its
    N side; Triton's software pipeline keeps num_stages tiles in flight.
Split-K partial sums are added inside the same launch by the last program of each N tile to finish
(`store_output`, quant_gemm_common.py): deterministic, no second kernel, counters left zeroed. The gated launch
interleaves each output's gate and up rows in a program's BLOCK_N weight rows and is never split (its 2I rows are
a layer's widest output, enough programs without it).
"""

import torch
import triton
import triton.language as tl

from tritonllm.kernels.activation import (
    GATED_ACTIVATIONS,
    gated_activation,
    gelu_tanh_and_mul_ref,
    silu_and_mul_ref,
)
from tritonllm.kernels.arrival_counters import arrival_counters
from tritonllm.kernels.dense_gemv_config import (
    MAX_GEMV_ROWS,
    GemvConfig,
    block_m,
    check_gemv_config,
    gemv_config,
    num_sms,
)
from tritonllm.kernels.dependent_launch import dependent_launch, wait_for_previous_kernel
from tritonllm.kernels.quant_gemm_common import store_output
from tritonllm.platform import INTERPRET, check_kernel_device

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _dense_gemv_kernel(
    x_ptr,
    w_ptr,
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
    stride_w_n,
    stride_out_m,
    stride_out_n,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # "": y = x @ W^T; "silu" | "gelu_tanh": the gated output, N = I
    SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr,
    PREFETCH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    # Weight rows past N re-read row N - 1 (in bounds, never stored): the weight loads need no row mask.
    if ACTIVATION == "":
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_idx = tl.minimum(offs_n, N - 1)
    else:  # BLOCK_N // 2 outputs; weight row 2j is output j's gate row, 2j + 1 its up row (I = N rows later)
        offs_r = tl.arange(0, BLOCK_N)
        w_idx = tl.minimum(pid_n * (BLOCK_N // 2) + offs_r // 2, N - 1) + (offs_r % 2) * N
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    w_rows = w_idx.to(tl.int64) * stride_w_n
    x_rows = offs_m.to(tl.int64) * stride_x_m
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    if USE_DOT:
        wait_for_previous_kernel(PDL)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            w = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :], mask=mask_k[None, :], other=0.0)
            x = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            if INTERPRET and x.dtype == tl.bfloat16:
                # bf16 tl.dot is wrong under the interpreter; fp32 operands compute the same product.
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        y = tl.trans(acc)
    else:
        w_ptrs = w_ptr + w_rows[None, :, None]  # [1, BLOCK_N, 1]
        x_ptrs = x_ptr + x_rows[:, None, None]  # [BLOCK_M, 1, 1]
        mask_x = mask_m[:, None, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        if PREFETCH:  # each weight tile is loaded one iteration ahead, never past this split's K range
            offs_k = k_start + tl.arange(0, BLOCK_K)[None, None, :]
            w = tl.load(w_ptrs + offs_k, mask=offs_k < k_end, other=0.0)
        # The weight is no earlier kernel's output: its first tile is in flight while the previous kernel drains.
        wait_for_previous_kernel(PDL)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)[None, None, :]
            mask_k = offs_k < k_end
            if PREFETCH:
                cur = w
                w = tl.load(w_ptrs + offs_k + BLOCK_K, mask=offs_k + BLOCK_K < k_end, other=0.0)
            else:
                cur = tl.load(w_ptrs + offs_k, mask=mask_k, other=0.0)
            x = tl.load(x_ptrs + offs_k, mask=mask_x & mask_k, other=0.0)
            acc += cur.to(tl.float32) * x.to(tl.float32)
        y = tl.sum(acc, axis=2)

    if ACTIVATION != "":
        if HAS_BIAS:
            y += tl.load(bias_ptr + w_idx)[None, :].to(tl.float32)
        gate, up = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))
        # Rounded to the output dtype first, as the unfused projection's output is.
        y = gated_activation(gate.to(out_ptr.dtype.element_ty), up.to(out_ptr.dtype.element_ty), ACTIVATION)
    store_output(
        y, offs_m, offs_n, pid_n, pid_s, M, N, split_k, stride_p_s, bias_ptr, out_ptr, partial_ptr, lock_ptr,
        stride_out_m, stride_out_n, HAS_BIAS and ACTIVATION == "", SPLIT,
    )  # fmt: skip


def _check(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> tuple[torch.Tensor, int, int, int]:
    """x as [M, K] (a view, never a copy) and (M, N, K), or a ValueError naming the problem and the fix."""
    if activation is not None and activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {', '.join(GATED_ACTIVATIONS)}, got {activation!r}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        got = f"weight {weight.dtype}" + ("" if bias is None else f", bias {bias.dtype}")
        raise ValueError(f"x, weight and bias must share one dtype: x is {x.dtype}, {got}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() < 2 or x.shape[-1] != k:
        raise ValueError(f"x must be [M, K={k}] to match weight {tuple(weight.shape)}, got {tuple(x.shape)}")
    if n == 0 or k == 0:
        raise ValueError(f"N and K must be positive, got weight {tuple(weight.shape)}")
    if activation is not None and n % 2:
        raise ValueError(f"a gated activation needs weight = [gate; up] (an even N), got {n} rows")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(
            f"x and weight need a contiguous last dim (strides {x.stride()} and {weight.stride()}); "
            "call .contiguous() on them"
        )
    try:
        x2 = x.view(-1, k)
    except RuntimeError:
        lead = tuple(x.shape[:-1])
        raise ValueError(f"x's leading dims {lead} do not flatten to rows without a copy; pass x as 2-D") from None
    m = x2.shape[0]
    if not 1 <= m <= MAX_GEMV_ROWS:
        raise ValueError(f"dense_gemv takes 1 to {MAX_GEMV_ROWS} rows, got {m}; use F.linear for larger batches")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [N={n}] tensor, got shape {tuple(bias.shape)}")
    tensors = (x, weight) if bias is None else (x, weight, bias)
    check_kernel_device(*tensors)
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"x, weight and bias must be on one device, got {[str(t.device) for t in tensors]}")
    return x2, m, n, k


def dense_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """y[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]) for 1 <= M <= 16 rows, like F.linear.

    x [M, K] (or leading dims that flatten to rows without a copy) and weight [N, K] need a contiguous last dim;
    x, weight and bias share one dtype (fp16, bf16 or fp32); fp32 accumulation; y has x's dtype and shape
    [..., N], written into `out` when given. `config` overrides the launch heuristics (dense_gemv_config.py);
    its block_n counts weight rows.
    With `activation` ("silu" or "gelu_tanh") weight is [gate; up] of 2I rows and y [..., I] is
    act(gate) * up, as silu_and_mul / gelu_tanh_and_mul give on the projection's output (bias added first).
    """
    x2, m, n, k = _check(x, weight, bias, activation)
    gated = activation is not None
    if gated:
        n //= 2  # outputs
    shape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif out.shape != shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be a {x.dtype} tensor of shape {shape} on {x.device}, got {out.dtype} {tuple(out.shape)} "
            f"on {out.device}"
        )
    try:
        out2 = out.view(m, n)
    except RuntimeError:
        raise ValueError(
            f"out's leading dims must flatten to rows without a copy, got strides {out.stride()}"
        ) from None
    cfg = config or gemv_config(m, weight.shape[0], k, x.dtype, num_sms(x.device.index or 0))
    check_gemv_config(cfg, m, gated)

    split = cfg.split_k if m * n < 2**31 and not gated else 1  # split-K offsets within a split are int32
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty splits
    grid = (triton.cdiv(n, cfg.block_n // 2 if gated else cfg.block_n), split_k)
    if split_k > 1:
        partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)  # [SPLIT_K, M, N]
        locks = arrival_counters(x.device, grid[0])
    else:
        partial = locks = out2  # unused pointers
    _dense_gemv_kernel[grid](
        x2, weight, bias if bias is not None else weight, out2, partial, locks,
        m, n, k, k_per_split, split_k, m * n, x2.stride(0), weight.stride(0), out2.stride(0), out2.stride(1),
        HAS_BIAS=bias is not None,
        ACTIVATION=activation or "",
        SPLIT=split_k > 1,
        USE_DOT=cfg.use_dot,
        PREFETCH=cfg.num_stages > 1,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        INTERPRET=INTERPRET,
        BLOCK_M=block_m(m, cfg.use_dot),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages if cfg.use_dot else 1,  # the CUDA-core path prefetches in registers instead
        **dependent_launch(x.device),
    )  # fmt: skip
    return out


def dense_gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 x @ weight^T (+ bias)."""
    y = x.float() @ weight.float().T
    return y if bias is None else y + bias.float()


_GATED_REFS = {"silu": silu_and_mul_ref, "gelu_tanh": gelu_tanh_and_mul_ref}


def gated_dense_gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, activation: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The unfused path: the projection rounded to x's dtype, then the activation kernel's reference (x's dtype)."""
    return _GATED_REFS[activation](dense_gemv_ref(x, weight, bias).to(x.dtype))
