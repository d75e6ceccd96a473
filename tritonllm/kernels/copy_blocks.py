"""Copy whole KV blocks inside the cache: the copy-on-write step of parallel sampling.

Cache layout (the runner's single KV tensor):
    kv_cache [2, num_layers, num_blocks, *block_shape]   (K at index 0, V at 1; block_shape is usually
                                                         [block_size, num_kv_heads, head_size])
Each (src, dst) row of block_mapping copies block src onto block dst for every layer, K and V.
"""

import torch
import triton
import triton.language as tl

from tritonllm.platform import check_kernel_device  # importing platform first sets TRITON_INTERPRET

# Elements one program moves: wide enough for full-bandwidth loads, small enough for many programs.
_MAX_TILE_ELEMS = 4096


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,
    mapping_ptr,
    num_layers,
    block_numel,
    stride_cache_kv,
    stride_cache_layer,
    stride_cache_block,
    stride_mapping_pair,
    stride_mapping_col,
    TILE: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    kv_layer = tl.program_id(1)
    tile = tl.program_id(2).to(tl.int64)
    # Block ids arrive as int64, so block * stride stays exact in caches past 2^31 elements.
    src = tl.load(mapping_ptr + pair * stride_mapping_pair)
    dst = tl.load(mapping_ptr + pair * stride_mapping_pair + stride_mapping_col)
    kv = (kv_layer // num_layers).to(tl.int64)
    layer = (kv_layer % num_layers).to(tl.int64)
    base = kv * stride_cache_kv + layer * stride_cache_layer
    offs = tile * TILE + tl.arange(0, TILE)
    mask = offs < block_numel
    vals = tl.load(cache_ptr + base + src * stride_cache_block + offs, mask=mask)
    tl.store(cache_ptr + base + dst * stride_cache_block + offs, vals, mask=mask)


def _tile_size(block_numel: int) -> int:
    return min(triton.next_power_of_2(block_numel), _MAX_TILE_ELEMS)


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """kv_cache[:, :, dst] = kv_cache[:, :, src] for every row (src, dst) of block_mapping, in place.

    kv_cache:       [2, num_layers, num_blocks, *block_shape], any dtype; the block_shape dims must be
                    contiguous (dims 0-2 may be strided, e.g. a permuted [num_layers, 2, ...] tensor).
    block_mapping:  [P, 2] int64, contiguous, on the cache's device. All pairs run at once, so the
                    destinations must be distinct and no block may be both a source and a destination
                    (BlockManager.take_block_copies guarantees both). Ids are trusted to lie in the cache.
    """
    check_kernel_device(kv_cache, block_mapping)
    if kv_cache.dim() < 3 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_layers, num_blocks, ...] (K and V stacked first), got {tuple(kv_cache.shape)}"
        )
    if block_mapping.dtype != torch.int64 or block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(
            f"block_mapping must be an int64 [P, 2] tensor of (src, dst) rows, got {block_mapping.dtype} "
            f"{tuple(block_mapping.shape)}; build it with torch.tensor(pairs, dtype=torch.long).view(-1, 2)"
        )
    if not block_mapping.is_contiguous():
        raise ValueError("block_mapping must be contiguous; call .contiguous() on it")
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0 or kv_cache.numel() == 0:
        return
    if not kv_cache[0, 0, 0].is_contiguous():
        raise ValueError(
            f"each cache block must be contiguous (strides {kv_cache.stride()}); only the K/V, layer and "
            "block dims may be strided"
        )
    num_layers = kv_cache.shape[1]
    block_numel = kv_cache[0, 0, 0].numel()
    tile = _tile_size(block_numel)
    # pairs on axis 0 (up to 2^31 - 1); K/V x layers and tiles stay far below the 65535 limit of axes 1-2.
    grid = (num_pairs, 2 * num_layers, triton.cdiv(block_numel, tile))
    _copy_blocks_kernel[grid](
        kv_cache,
        block_mapping,
        num_layers,
        block_numel,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_mapping.stride(0),
        block_mapping.stride(1),
        TILE=tile,
    )


def copy_blocks_ref(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Plain-PyTorch version of `copy_blocks`, in place: read every source first, then write."""
    pairs = block_mapping.tolist()
    sources = [kv_cache[:, :, src].clone() for src, _ in pairs]
    for (_, dst), data in zip(pairs, sources, strict=True):
        kv_cache[:, :, dst] = data
