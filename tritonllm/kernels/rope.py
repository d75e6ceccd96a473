"""Rotary position embedding applied in place to q and k (neox half-split or gptj interleaved pairs)."""

import torch
import triton
import triton.language as tl

from tritonllm.platform import check_kernel_device


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    head_start,
    num_heads,
    stride_x_t,
    stride_x_h,
    cos,
    sin,
    half_offs,
    half_mask,
    half,
    IS_NEOX: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    heads = (head_start + tl.arange(0, BLOCK_HEADS)).to(tl.int64)
    mask = (heads < num_heads)[:, None] & half_mask[None, :]
    row_ptrs = x_ptr + token * stride_x_t + heads[:, None] * stride_x_h
    if IS_NEOX:
        ptrs1 = row_ptrs + half_offs[None, :]  # pairs (i, i + rot_dim / 2)
        ptrs2 = ptrs1 + half
    else:
        ptrs1 = row_ptrs + 2 * half_offs[None, :]  # pairs (2i, 2i + 1)
        ptrs2 = ptrs1 + 1
    x1 = tl.load(ptrs1, mask=mask, other=0.0)
    x2 = tl.load(ptrs2, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(ptrs1, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(ptrs2, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _apply_rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    num_q_heads,
    num_k_heads,
    half,
    stride_pos,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_cache_pos,
    IS_NEOX: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # grid = (T, q head blocks + k head blocks): one token's cos/sin row, one block of heads of q or of k.
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    pos = tl.load(pos_ptr + token * stride_pos).to(tl.int64)
    half_offs = tl.arange(0, BLOCK_HALF)
    half_mask = half_offs < half
    cache_row = cache_ptr + pos * stride_cache_pos
    cos = tl.load(cache_row + half_offs, mask=half_mask, other=0.0)[None, :]
    sin = tl.load(cache_row + half + half_offs, mask=half_mask, other=0.0)[None, :]
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_HEADS)
    if head_block < num_q_blocks:
        _rotate_heads(
            q_ptr,
            token,
            head_block * BLOCK_HEADS,
            num_q_heads,
            stride_q_t,
            stride_q_h,
            cos,
            sin,
            half_offs,
            half_mask,
            half,
            IS_NEOX,
            BLOCK_HEADS,
        )
    else:
        _rotate_heads(
            k_ptr,
            token,
            (head_block - num_q_blocks) * BLOCK_HEADS,
            num_k_heads,
            stride_k_t,
            stride_k_h,
            cos,
            sin,
            half_offs,
            half_mask,
            half,
            IS_NEOX,
            BLOCK_HEADS,
        )


def _check(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be a 1-D int32/int64 tensor [T], got {positions.dtype} {tuple(positions.shape)}"
        )
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be [T, heads, head_dim], got {tuple(t.shape)}; view a flat [T, heads * D] as 3-D"
            )
        if t.shape[0] != positions.shape[0]:
            raise ValueError(f"{name} has {t.shape[0]} tokens but positions has {positions.shape[0]}")
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride {t.stride(2)}); pass {name}.contiguous()")
    if q.dtype != k.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q and k must share one of float16/bfloat16/float32, got {q.dtype} and {k.dtype}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must share head_dim, got {q.shape[2]} and {k.shape[2]}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.dtype != torch.float32:
        raise ValueError(
            f"cos_sin_cache must be [max_pos, rot_dim] float32, got {cos_sin_cache.dtype} "
            f"{tuple(cos_sin_cache.shape)}; build it with get_rope"
        )
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 != 0 or rot_dim == 0 or rot_dim > q.shape[2]:
        raise ValueError(f"rot_dim {rot_dim} must be even, positive and <= head_dim {q.shape[2]}")
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be contiguous in its last dim; pass cos_sin_cache.contiguous()")
    check_kernel_device(positions, q, k, cos_sin_cache)


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k IN PLACE by their token's position; returns (q, k).

    For pair (x1, x2) of a head and frequency i < rot_dim / 2, with c, s = cache[pos, i], cache[pos, rot_dim/2 + i]:
        x1' = x1 c - x2 s,    x2' = x2 c + x1 s        (fp32 math, rounded once to q's dtype)
    is_neox=True pairs (i, i + rot_dim / 2); False pairs (2i, 2i + 1). Dims >= rot_dim pass through.

    positions: [T] int32/int64, each in [0, max_pos) (not checked: that would sync the GPU).
    q: [T, Hq, D], k: [T, Hk, D] fp16/bf16/fp32; head_dim contiguous, token and head strides free
    (views of a fused qkv output work). cos_sin_cache: [max_pos, rot_dim] fp32 = [cos | sin] per position.
    """
    _check(positions, q, k, cos_sin_cache)
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return q, k
    half = cos_sin_cache.shape[1] // 2
    block_half = triton.next_power_of_2(half)
    block_heads = min(triton.next_power_of_2(max(q.shape[1], k.shape[1])), max(1, 1024 // block_half))
    grid = (num_tokens, triton.cdiv(q.shape[1], block_heads) + triton.cdiv(k.shape[1], block_heads))
    _apply_rotary_kernel[grid](
        positions,
        q,
        k,
        cos_sin_cache,
        q.shape[1],
        k.shape[1],
        half,
        positions.stride(0),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        IS_NEOX=is_neox,
        BLOCK_HEADS=block_heads,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
    return q, k


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot_dim = 2 * cos.shape[-1]
    out = x.float().clone()
    r = out[..., :rot_dim]
    if is_neox:
        x1, x2 = r[..., : rot_dim // 2], r[..., rot_dim // 2 :]
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        out[..., :rot_dim] = torch.cat([o1, o2], dim=-1)
    else:
        out[..., :rot_dim] = torch.stack([o1, o2], dim=-1).flatten(-2)
    return out.to(x.dtype)


def apply_rotary_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference returning new rotated (q, k); inputs are left untouched."""
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, rot_dim / 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return _rotate_ref(q, cos, sin, is_neox), _rotate_ref(k, cos, sin, is_neox)
