"""RMSNorm and the fused residual-add + RMSNorm of a pre-norm decoder layer."""

import torch
import triton
import triton.language as tl

from tritonllm.kernels.dependent_launch import dependent_launch, wait_for_previous_kernel
from tritonllm.platform import check_kernel_device

_MAX_HIDDEN = 65536  # one row lives in registers; beyond this a split-row kernel would be needed


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    M,
    M1,
    H,
    stride_x_0,
    stride_x_1,
    stride_res_0,
    stride_res_1,
    stride_out_0,
    stride_out_1,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # Rows are addressed through a [M0, M1, H] view: row r sits at (r // M1, r % M1), which covers
    # per-head views of a fused qkv output (token stride != heads * head_dim).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    i0 = rows // M1
    i1 = rows % M1
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < M)[:, None] & (cols < H)[None, :]

    x_offs = (i0 * stride_x_0 + i1 * stride_x_1)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res_offs = (i0 * stride_res_0 + i1 * stride_res_1)[:, None] + cols[None, :]
        res = tl.load(res_ptr + res_offs, mask=mask, other=0.0)
        # The sum is rounded to the residual's dtype first: the norm sees exactly the stored residual.
        x = (res.to(tl.float32) + x.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + res_offs, x, mask=mask)

    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / H + eps)
    # HF Llama rounding: normalise in fp32, cast to the input dtype, then scale by the weight.
    normed = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    out_offs = (i0 * stride_out_0 + i1 * stride_out_1)[:, None] + cols[None, :]
    tl.store(out_ptr + out_offs, (normed * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_config(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_H, num_warps): small rows (per-head norms) are packed several per program."""
    block_h = triton.next_power_of_2(hidden)
    block_m = max(1, min(64, 4096 // block_h))
    num_warps = min(16, max(1, block_m * block_h // 512))
    return block_m, block_h, num_warps


def _as_rows(tensors: list[torch.Tensor], names: list[str]) -> list[torch.Tensor]:
    """Views of each tensor as [M0, M1, H] with a stride-1 last dim; M1 = 1 whenever every tensor allows it."""
    hidden = tensors[0].shape[-1]
    for t, name in zip(tensors, names, strict=True):
        if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dim (stride {t.stride(-1)}); pass {name}.contiguous()"
            )
    try:
        return [t.view(-1, 1, hidden) for t in tensors]
    except RuntimeError:
        pass
    try:
        return [t.view(-1, t.shape[-2], hidden) for t in tensors]
    except RuntimeError:
        raise ValueError(
            f"{', '.join(names)} with strides {[t.stride() for t in tensors]} cannot be addressed as rows of two "
            "leading strides; pass a .contiguous() copy"
        ) from None


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not x.is_floating_point() or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dim [..., H]")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [H] = [{x.shape[-1]}] to match x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be floating point, got {weight.dtype}")
    if weight.stride(0) != 1 and weight.shape[0] > 1:
        raise ValueError("weight must be contiguous; pass weight.contiguous()")
    if x.shape[-1] > _MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[-1]} exceeds the single-tile limit {_MAX_HIDDEN}")
    check_kernel_device(x, weight)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    hidden = x.shape[-1]
    if residual is None:
        x3, out3 = _as_rows([x, out], ["x", "out"])
        res3 = x3  # unused: HAS_RESIDUAL=False
    else:
        x3, res3, out3 = _as_rows([x, residual, out], ["x", "residual", "out"])
    rows = x3.shape[0] * x3.shape[1]
    block_m, block_h, num_warps = _launch_config(hidden)
    _rms_norm_kernel[(triton.cdiv(rows, block_m),)](
        x3,
        res3,
        weight,
        out3,
        rows,
        x3.shape[1],
        hidden,
        x3.stride(0),
        x3.stride(1),
        res3.stride(0),
        res3.stride(1),
        out3.stride(0),
        out3.stride(1),
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK_M=block_m,
        BLOCK_H=block_h,
        num_warps=num_warps,
        **dependent_launch(x.device),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype) * weight, in fp32, rounded once to x.dtype.

    x: [..., H] fp16/bf16/fp32, any leading shape; the last dim must be contiguous and the leading dims must
    collapse into at most two strides (e.g. a [T, heads, head_dim] view of a fused qkv output).
    weight: [H], any float dtype. Returns a new contiguous tensor of x's shape and dtype.
    """
    _check(x, weight)
    return _launch(x, None, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x IN PLACE (in residual's dtype), then returns rms_norm(residual) in x's dtype.

    x, residual: [..., H] of the same shape (dtypes may differ, e.g. an fp32 residual stream); weight: [H].
    """
    _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    if residual.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"residual must be float16, bfloat16 or float32, got {residual.dtype}")
    check_kernel_device(residual)
    return _launch(x, residual, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain PyTorch reference with HF Llama's rounding points."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference returning (normed output, updated residual) without touching its inputs."""
    new_residual = (residual.float() + x.float()).to(residual.dtype)
    xf = new_residual.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(residual.dtype)
    return (normed.float() * weight.float()).to(x.dtype), new_residual
