"""Rotary position embedding applied in place to q and k (neox half-split or gptj interleaved pairs), or to q in place
and to k on its way into the paged KV cache, with v, in the same launch (`apply_rotary_and_cache`)."""

import torch
import triton
import triton.language as tl

from tritonllm.kernels.dependent_launch import dependent_launch, wait_for_previous_kernel
from tritonllm.kernels.kv_cache import cache_slot_rows, check_kv_write
from tritonllm.platform import check_kernel_device


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    src_rows,
    dst_rows,
    head_mask,
    cos,
    sin,
    half_offs,
    half_mask,
    half,
    IS_NEOX: tl.constexpr,
):
    """Rotate the heads whose row offsets are src_rows [BLOCK_HEADS] and store them at dst_rows (in place when
    both are the same rows)."""
    mask = head_mask[:, None] & half_mask[None, :]
    if IS_NEOX:
        offs1 = half_offs[None, :]  # pairs (i, i + rot_dim / 2)
        offs2 = offs1 + half
    else:
        offs1 = 2 * half_offs[None, :]  # pairs (2i, 2i + 1)
        offs2 = offs1 + 1
    x1 = tl.load(src_ptr + src_rows[:, None] + offs1, mask=mask, other=0.0)
    x2 = tl.load(src_ptr + src_rows[:, None] + offs2, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(dst_ptr + dst_rows[:, None] + offs1, (x1f * cos - x2f * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_ptr + dst_rows[:, None] + offs2, (x2f * cos + x1f * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _apply_rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_q_heads,
    num_k_heads,
    half,
    stride_pos,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_cache_pos,
    stride_v_t,
    stride_v_h,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    IS_NEOX: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid = (T, q head blocks + k head blocks): one token's cos/sin row, one block of heads of q or of k (and v).
    wait_for_previous_kernel(PDL)
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
        heads = (head_block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)).to(tl.int64)
        rows = token * stride_q_t + heads * stride_q_h
        _rotate_heads(q_ptr, q_ptr, rows, rows, heads < num_q_heads, cos, sin, half_offs, half_mask, half, IS_NEOX)
    else:
        heads = ((head_block - num_q_blocks) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)).to(tl.int64)
        head_mask = heads < num_k_heads
        k_rows = token * stride_k_t + heads * stride_k_h
        if WRITE_CACHE:
            # k rotated straight into its cache slot (k itself untouched), v copied next to it; -1 skips.
            slot = tl.load(slot_mapping_ptr + token)
            if slot >= 0:
                kc_rows = cache_slot_rows(slot, heads, stride_kc_block, stride_kc_slot, stride_kc_head, BLOCK_SIZE)
                vc_rows = cache_slot_rows(slot, heads, stride_vc_block, stride_vc_slot, stride_vc_head, BLOCK_SIZE)
                _rotate_heads(k_ptr, k_cache_ptr, k_rows, kc_rows, head_mask, cos, sin, half_offs, half_mask, half,
                              IS_NEOX)  # fmt: skip
                offs_d = tl.arange(0, BLOCK_D)[None, :]
                row_mask = head_mask[:, None] & (offs_d < HEAD_SIZE)
                rest = row_mask & (offs_d >= 2 * half)  # dims past rot_dim pass through
                tl.store(k_cache_ptr + kc_rows[:, None] + offs_d, tl.load(k_ptr + k_rows[:, None] + offs_d, mask=rest),
                         mask=rest)  # fmt: skip
                v_rows = token * stride_v_t + heads * stride_v_h
                tl.store(v_cache_ptr + vc_rows[:, None] + offs_d, tl.load(v_ptr + v_rows[:, None] + offs_d,
                         mask=row_mask), mask=row_mask)  # fmt: skip
        else:
            _rotate_heads(k_ptr, k_ptr, k_rows, k_rows, head_mask, cos, sin, half_offs, half_mask, half, IS_NEOX)


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
    _launch(positions, q, k, cos_sin_cache, is_neox, None)
    return q, k


def apply_rotary_and_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`apply_rotary` on q, and `write_kv_cache` of rotated k and of v, in one launch; returns q.

    q is rotated IN PLACE; k's rotation goes to its cache slot only (k and v are not written). Arguments as for
    apply_rotary (q, k, cos_sin_cache, is_neox, positions) and write_kv_cache (v like k; k_cache, v_cache
    [num_blocks, block_size, Hk, D]; slot_mapping [T] int64, -1 skips the token).
    """
    _check(positions, q, k, cos_sin_cache)
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    _launch(positions, q, k, cos_sin_cache, is_neox, (v, k_cache, v_cache, slot_mapping))
    return q


def _launch(positions, q, k, cos_sin_cache, is_neox, cache_write) -> None:
    num_tokens, head_size = q.shape[0], q.shape[2]
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[1] // 2
    block_half = triton.next_power_of_2(half)
    block_d = triton.next_power_of_2(head_size)
    # Up to 1024 elements a tile: rotation halves, or whole heads where v is copied too.
    block_heads = triton.next_power_of_2(max(q.shape[1], k.shape[1]))
    block_heads = min(block_heads, max(1, 1024 // (block_half if cache_write is None else block_d)))
    grid = (num_tokens, triton.cdiv(q.shape[1], block_heads) + triton.cdiv(k.shape[1], block_heads))
    v, k_cache, v_cache, slot_mapping = cache_write or (k, k, k, positions)  # the latter never read
    _apply_rotary_kernel[grid](
        positions,
        q,
        k,
        cos_sin_cache,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        q.shape[1],
        k.shape[1],
        half,
        positions.stride(0),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        v.stride(0),
        v.stride(1),
        *(k_cache.stride()[:3] if cache_write else (0, 0, 0)),
        *(v_cache.stride()[:3] if cache_write else (0, 0, 0)),
        IS_NEOX=is_neox,
        WRITE_CACHE=cache_write is not None,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=k_cache.shape[1] if cache_write else 1,
        BLOCK_HEADS=block_heads,
        BLOCK_HALF=block_half,
        BLOCK_D=block_d,
        num_warps=4,
        **dependent_launch(q.device),
    )


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
