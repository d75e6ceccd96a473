"""Scatter this step's keys and values into the paged KV cache.

Cache layout (one pair per layer, views of the runner's single KV tensor):
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_size]
Token t goes to slot s = slot_mapping[t] = block_id * block_size + offset; s = -1 writes nothing
(padding tokens of a captured batch, or tokens whose KV is not kept).
"""

import torch
import triton
import triton.language as tl

from tritonllm.kernels.dependent_launch import dependent_launch, wait_for_previous_kernel
from tritonllm.platform import check_kernel_device  # importing platform first sets TRITON_INTERPRET

# Elements one program moves: enough to keep loads wide, small enough for many programs per token batch.
_MAX_TILE_ELEMS = 4096


@triton.jit
def cache_slot_rows(slot, heads, stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr):
    """Element offsets of `heads`' rows of slot `slot` (int64: block * stride_block passes 2^31 in a large cache)
    in a [num_blocks, BLOCK_SIZE, num_kv_heads, head_size] cache; the KV write and the fused rotary kernel share it."""
    slot = slot.to(tl.int64)
    return (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot + heads * stride_head


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0)
    head_tile = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return

    offs_h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE)

    token64 = token.to(tl.int64)
    src_k = token64 * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :]
    src_v = token64 * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :]
    kc_rows = cache_slot_rows(slot, offs_h, stride_kc_block, stride_kc_slot, stride_kc_head, BLOCK_SIZE)
    vc_rows = cache_slot_rows(slot, offs_h, stride_vc_block, stride_vc_slot, stride_vc_head, BLOCK_SIZE)
    dst_k = kc_rows[:, None] + offs_d[None, :]
    dst_v = vc_rows[:, None] + offs_d[None, :]

    k = tl.load(key_ptr + src_k, mask=mask)
    v = tl.load(value_ptr + src_v, mask=mask)
    tl.store(k_cache_ptr + dst_k, k, mask=mask)
    tl.store(v_cache_ptr + dst_v, v, mask=mask)


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The paged layout every kernel shares: two equal tensors [num_blocks, block_size, num_kv_heads, head_size]."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_size], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


def check_kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise a ValueError naming the problem unless `write_kv_cache(key, value, k_cache, v_cache, slot_mapping)`
    can run (shapes, dtypes, strides, devices)."""
    check_kernel_device(key, value, k_cache, v_cache, slot_mapping)
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_size], got {tuple(key.shape)} and "
            f"{tuple(value.shape)}; reshape the projection output with .view(T, Hk, D)"
        )
    check_cache_pair(k_cache, v_cache)
    num_tokens, num_kv_heads, head_size = key.shape
    _, _, cache_heads, cache_head_size = k_cache.shape
    if (cache_heads, cache_head_size) != (num_kv_heads, head_size):
        raise ValueError(
            f"key has {num_kv_heads} heads of size {head_size} but the cache holds {cache_heads} heads of size "
            f"{cache_head_size}; allocate the cache with the model's num_kv_heads and head_size"
        )
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"dtype mismatch: key {key.dtype}, value {value.dtype}, k_cache {k_cache.dtype}, v_cache "
            f"{v_cache.dtype}; allocate the cache in the model dtype"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping must be int64 of shape [{num_tokens}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}; build it with torch.long"
        )
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last (head_size) dim, got strides {t.stride()}")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous; call .contiguous() on it")


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache[s // bs, s % bs] = key[t] and v_cache[...] = value[t] for s = slot_mapping[t] >= 0.

    key, value:        [T, Hk, D], cache dtype; the last dim contiguous, token/head strides free
                       (views into a fused qkv projection output are fine).
    k_cache, v_cache:  [num_blocks, block_size, Hk, D], the last dim contiguous.
    slot_mapping:      [T] int64; -1 skips the token. Slots are trusted to lie inside the cache.
    Writes in place; returns nothing.
    """
    check_kv_write(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_size = key.shape
    block_size = k_cache.shape[1]
    if num_tokens == 0:
        return

    block_d = triton.next_power_of_2(head_size)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE_ELEMS // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_cache_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        **dependent_launch(key.device),
    )


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-PyTorch version of `write_kv_cache`: one token at a time, in place."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[t]
        v_cache[slot // block_size, slot % block_size] = value[t]
