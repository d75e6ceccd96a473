"""Gated MLP activations: act(x[..., :I]) * x[..., I:] on the fused gate_up projection output."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tritonllm.kernels.dependent_launch import dependent_launch, wait_for_previous_kernel
from tritonllm.platform import check_kernel_device

_MAX_BLOCK = 1024
GATED_ACTIVATIONS = ("silu", "gelu_tanh")  # what `gated_activation` computes


@triton.jit
def gated_activation(gate, up, ACTIVATION: tl.constexpr):
    """act(gate) * up in fp32 for gate and up of the model's dtype ("silu" | "gelu_tanh"). The activation is
    rounded to that dtype before the product, as HF's act_fn(gate) * up rounds it."""
    g = gate.to(tl.float32)
    if ACTIVATION == "silu":
        act = g * tl.sigmoid(g)
    else:
        # 0.5 g (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3): no tanh needed
        act = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    return act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    I,
    stride_x_row,
    stride_out_row,
    ACTIVATION: tl.constexpr,  # "silu" | "gelu_tanh"
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate_ptrs = x_ptr + row * stride_x_row + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + I, mask=mask, other=0.0)
    out = gated_activation(gate, up, ACTIVATION)
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x must be [..., 2 * I] with an even last dim, got {tuple(x.shape)}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous in its last dim (stride {x.stride(-1)}); pass x.contiguous()")
    check_kernel_device(x)
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    try:
        x2 = x.view(-1, 2 * inter)  # [M, 2I], rows may be strided (a slice of a wider output)
    except RuntimeError:
        raise ValueError(
            f"x with strides {x.stride()} cannot be addressed as rows of one stride; pass x.contiguous()"
        ) from None
    out2 = out.view(-1, inter)  # [M, I] contiguous
    block = min(_MAX_BLOCK, triton.next_power_of_2(inter))
    grid = (x2.shape[0], triton.cdiv(inter, block))
    _act_and_mul_kernel[grid](
        x2, out2, inter, x2.stride(0), out2.stride(0), ACTIVATION=activation, BLOCK=block, num_warps=4,
        **dependent_launch(x.device),
    )  # fmt: skip
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """out = silu(x[..., :I]) * x[..., I:], silu(g) = g * sigmoid(g); fp32 math, silu rounded to x.dtype.

    x: [..., 2I] fp16/bf16/fp32 with a contiguous last dim. Returns a new [..., I] tensor of x's dtype.
    """
    return _act_and_mul(x, "silu")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """out = gelu_tanh(x[..., :I]) * x[..., I:], gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))).

    x: [..., 2I] fp16/bf16/fp32 with a contiguous last dim. Returns a new [..., I] tensor of x's dtype.
    """
    return _act_and_mul(x, "gelu_tanh")


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate).to(x.dtype).float() * up).to(x.dtype)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh").to(x.dtype).float() * up).to(x.dtype)
