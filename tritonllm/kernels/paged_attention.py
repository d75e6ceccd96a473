"""Causal attention of a mixed flat batch (decode, prefill, chunked prefill, prefix hits) over the paged KV cache.

One kernel for every step: sequence i owns query tokens query_start_loc[i]:query_start_loc[i+1], its last
query_len tokens (positions seq_len - query_len .. seq_len - 1); the KV of all seq_len tokens, the new ones
included, is already in the cache (`write_kv_cache` runs first). A decode step is query_len = 1, a fresh
prefill is query_len = seq_len, everything else is a prefill over a cached prefix.

Grid: (query tiles, kv head groups, KV splits). A query tile is BLOCK_Q tokens of one sequence times the
Hq / Hk query heads that share one KV head, packed as BLOCK_M rows, so each K/V tile loaded serves the whole
GQA group. Each program walks its KV positions TILE_N at a time through the block table, skipping tiles that
causality or the sliding window mask out entirely, with an fp32 online softmax.

Split-KV (flash-decoding): when every sequence fits one query tile, a third grid axis cuts each sequence's
visible KV range into num_splits runs of whole tiles; each program stores its normalised partial output and
log-sum-exp; the last program of a tile to finish merges them (`merge_splits_in_launch`), or a second launch does
(`merge_attention_partials`), both in paged_attention_split.py.

Under the interpreter one program may cover all KV heads (KV_HEADS > 1): the heads sit side by side along
the head dim, each query row keeps only its own head's columns of q, so q @ K^T is every row's dot with its
own KV head, and only those columns of p @ V are stored. The GPU always runs KV_HEADS = 1. Launch shapes:
paged_attention_config.py.
"""

import torch
import triton
import triton.language as tl

from tritonllm.kernels.arrival_counters import arrival_counters
from tritonllm.kernels.dependent_launch import dependent_launch, wait_for_previous_kernel
from tritonllm.kernels.kv_cache import check_cache_pair
from tritonllm.kernels.paged_attention_config import (
    PagedAttentionConfig,
    check_config,
    current_target,
    paged_attention_config,
)
from tritonllm.kernels.paged_attention_split import merge_attention_partials, merge_splits_in_launch
from tritonllm.platform import INTERPRET, check_kernel_device

_MAX_HEAD_SIZE = 256
_MAX_INT32 = 2**31 - 1
_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence s owns the tiles from query_start_loc[s] // BLOCK_Q + s on: that count bounds the tiles of all
    # earlier sequences from above, and it grows strictly with s, so a binary search finds the owner.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The per-step counts stay runtime integers: specialized (== 1, multiple of 16), each new class of batch an eager
# step meets would compile another variant in the middle of serving.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "min_query_len", "max_query_len"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    part_out_ptr,
    part_lse_ptr,
    counters_ptr,
    qk_scale,
    num_seqs,
    num_splits,
    min_query_len,
    max_query_len,
    stride_q_t,
    stride_q_h,
    stride_out_t,
    stride_out_h,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_bt_seq,
    stride_po_t,
    stride_po_h,
    stride_po_s,
    stride_pl_t,
    stride_pl_h,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    KV_HEADS: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,
    ONE_TILE_PER_SEQ: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    MERGE_IN_LAUNCH: tl.constexpr,
    MERGE_SPLITS_PADDED: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    SPLIT_MIN_TILES: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    IDX: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # IDX: int32 compiled; int64 under the interpreter, which checks every int32 add/mul for overflow with ~8
    # extra ops (int64 is not checked), a large share of a program's cost there.
    if ONE_TILE_PER_SEQ:
        seq = tl.program_id(0).to(IDX)
        local_tile = 0
    else:
        q_tile = tl.program_id(0).to(IDX)
        seq = _find_seq(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q).to(IDX)
        local_tile = q_tile - (tl.load(query_start_loc_ptr + seq).to(IDX) // BLOCK_Q + seq)
    # Loaded together before any branch: each is a round trip to memory, and decode programs are short.
    q_start = tl.load(query_start_loc_ptr + seq).to(IDX)
    query_len = tl.load(query_start_loc_ptr + seq + 1).to(IDX) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(IDX)
    if local_tile * BLOCK_Q >= query_len:
        return  # an idle sequence, or one of the up to one surplus tiles per sequence the grid counts
    if (query_len < min_query_len) | (query_len > max_query_len):
        return  # the other launch of a mixed step serves this sequence (config.short_queries)
    context_len = seq_len - query_len
    kv_head0 = tl.program_id(1).to(IDX) * KV_HEADS

    # Row r of the tile: query token r // (KV_HEADS * QUERIES_PER_KV) of the tile, then its heads in order.
    offs_m = tl.arange(0, BLOCK_M).to(IDX)
    q_local = local_tile * BLOCK_Q + offs_m // (KV_HEADS * QUERIES_PER_KV)
    head_in_prog = offs_m % (KV_HEADS * QUERIES_PER_KV)
    q_head = kv_head0 * QUERIES_PER_KV + head_in_prog
    row_valid = (offs_m < BLOCK_Q * KV_HEADS * QUERIES_PER_KV) & (q_local < query_len)
    q_pos = context_len + q_local

    # Column c: element c % HEAD_SIZE_PADDED of KV head kv_head0 + c // HEAD_SIZE_PADDED.
    offs_c = tl.arange(0, KV_HEADS_PADDED * HEAD_SIZE_PADDED).to(IDX)
    if KV_HEADS == 1:
        offs_d = offs_c
        col_valid = offs_c < HEAD_SIZE
        k_cols = kv_head0 * stride_kc_head + offs_c
        v_cols = kv_head0 * stride_vc_head + offs_c
        own = row_valid[:, None] & col_valid[None, :]
    else:
        col_head = offs_c // HEAD_SIZE_PADDED
        offs_d = offs_c % HEAD_SIZE_PADDED
        col_valid = (offs_d < HEAD_SIZE) & (col_head < KV_HEADS)
        k_cols = (kv_head0 + col_head) * stride_kc_head + offs_d
        v_cols = (kv_head0 + col_head) * stride_vc_head + offs_d
        own = row_valid[:, None] & col_valid[None, :] & (col_head[None, :] == (head_in_prog // QUERIES_PER_KV)[:, None])

    token = (q_start + q_local).to(tl.int64)
    q_offs = token[:, None] * stride_q_t + q_head[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=own, other=0.0)
    if INTERPRET and q.dtype == tl.bfloat16:
        # The interpreter's bf16 tl.dot is wrong (compiled runs keep bf16). Exact bf16 -> fp32 by moving the bits
        # up, inline: the interpreter's own cast walks every bit of every element, and a helper call re-patches
        # triton.language on each call.
        q = (q.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, KV_HEADS_PADDED * HEAD_SIZE_PADDED], dtype=tl.float32)

    # Keys this tile can see: causality ends at its last query, the window starts before its first query.
    kv_end = context_len + tl.minimum((local_tile + 1) * BLOCK_Q, query_len)
    kv_start = 0
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(context_len + local_tile * BLOCK_Q - SLIDING_WINDOW + 1, 0)
    lo = (kv_start // TILE_N) * TILE_N
    hi = kv_end
    if SPLIT_KV:
        # This program's run of whole tiles (at least SPLIT_MIN_TILES); the sequence's own length sets the run,
        # so a launch sized for a longer max_seq_len leaves the trailing splits empty rather than unbalanced.
        split = tl.program_id(2).to(IDX)
        num_tiles = tl.cdiv(kv_end - lo, TILE_N)  # >= 1: a scheduled query sees at least itself
        tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), SPLIT_MIN_TILES)
        if MERGE_IN_LAUNCH:
            # Only the splits that hold keys take part (a short sequence in a launch planned for max_model_len
            # leaves most of them empty): the rest neither store partials nor arrive, and the merge reads fewer.
            used_splits = tl.cdiv(num_tiles, tiles_per_split)
            if split >= used_splits:
                return
        lo = lo + split * tiles_per_split * TILE_N
        hi = tl.minimum(lo + tiles_per_split * TILE_N, kv_end)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for n_start in range(lo, hi, TILE_N):
        offs_n = n_start + tl.arange(0, TILE_N).to(IDX)
        n_valid = offs_n < hi
        # int64: block_id * stride_block passes 2^31 in a large cache.
        block_id = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        kv_mask = n_valid[:, None] & col_valid[None, :]
        k_offs = block_id[:, None] * stride_kc_block + in_block[:, None] * stride_kc_slot + k_cols[None, :]
        v_offs = block_id[:, None] * stride_vc_block + in_block[:, None] * stride_vc_slot + v_cols[None, :]
        k = tl.load(k_cache_ptr + k_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_offs, mask=kv_mask, other=0.0)
        if INTERPRET and k.dtype == tl.bfloat16:
            k = (k.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            v = (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)

        # Scores in the log2 domain: qk_scale = scale * log2(e), so exp2 below is the softmax's exp.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        allowed = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps m = -inf; subtract 0 there instead of producing inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if SPLIT_KV:
        # Natural-log LSE of this split's scores (log2 domain x ln 2; -inf for an empty split): the merge weighs
        # splits by it.
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        po_offs = token[:, None] * stride_po_t + q_head[:, None] * stride_po_h + split * stride_po_s + offs_d[None, :]
        tl.store(part_out_ptr + po_offs, out, mask=own)
        tl.store(part_lse_ptr + token * stride_pl_t + q_head * stride_pl_h + split, lse, mask=row_valid)
        if MERGE_IN_LAUNCH:
            # One counter per (sequence, KV head program): split-KV runs one query tile per sequence.
            merge_splits_in_launch(
                out_ptr, part_out_ptr, part_lse_ptr, counters_ptr + seq * tl.num_programs(1) + tl.program_id(1),
                token, q_head, offs_d, row_valid, own, used_splits, stride_out_t, stride_out_h, stride_po_t,
                stride_po_h, stride_po_s, stride_pl_t, stride_pl_h, MERGE_SPLITS_PADDED, MERGE_CHUNK,
            )  # fmt: skip
    else:
        out_offs = token[:, None] * stride_out_t + q_head[:, None] * stride_out_h + offs_d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=own)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: PagedAttentionConfig | None = None,
) -> torch.Tensor:
    """out[t, h] = sum_j softmax_j(scale * q[t, h] . k_j) v_j over the keys j that query t may see.

    Query t of sequence i sits at position p = seq_len_i - query_len_i + (t - query_start_loc[i]) and sees the
    keys at positions j <= p (and j > p - sliding_window when a window is set: the last `sliding_window` tokens,
    itself included). Query head h reads KV head h // (Hq // Hk). Softmax in fp32; fp32 inputs use true fp32
    products (no TF32).

    q:               [T, Hq, D] fp16/bf16/fp32, last dim contiguous (a view of a fused qkv output is fine)
    k_cache/v_cache: [num_blocks, block_size, Hk, D], q's dtype, last dim contiguous; Hq % Hk == 0
    query_start_loc: [B + 1] int32, cumulative query lengths from 0
    seq_lens:        [B] int32, tokens in context including this step's queries
    block_tables:    [B, max_blocks] int32, physical block ids; entries past a sequence's length are not read
    max_query_len:   host-side bound on every query_len (>= the true max; picks the tiles, no device sync)
    max_seq_len:     host-side bound on every seq_len (>= the true max, e.g. max_model_len inside a CUDA graph);
                     with the SM count it picks the number of KV splits
    out:             optional [T, Hq, D] in q's dtype, last dim contiguous; rows past query_start_loc[-1] untouched
    num_splits:      None chooses; > 1 forces split-KV where it applies (see paged_attention_config)
    config:          a launch configuration to use instead of the heuristics (benchmark sweeps, tests)
    Returns out. No host syncs and no decision on tensor contents: safe to capture in a CUDA graph.
    """
    _check_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, sliding_window)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim, got {tuple(out.shape)} {out.dtype} "
            f"strides {out.stride()}"
        )
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads, num_seqs = k_cache.shape[2], seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    queries_per_kv = num_heads // num_kv_heads
    if config is None:
        config = paged_attention_config(
            num_seqs=num_seqs,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=q.dtype,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            sliding_window=sliding_window,
            num_splits=num_splits,
            target=current_target(q.device.index or 0) if q.is_cuda else None,
        )
    check_config(config, num_kv_heads, queries_per_kv, max_query_len)
    tensors = (out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    short = config.short_queries
    if short is None:
        _launch(*tensors, scale, sliding_window, config, max_query_len, (1, _MAX_INT32))
    else:
        # Two launches over the same batch, each serving the sequences the other skips (decided on the device
        # from query_start_loc, so a CUDA graph replays any mix).
        _launch(*tensors, scale, sliding_window, short, short.block_q, (1, short.block_q))
        _launch(*tensors, scale, sliding_window, config, max_query_len, (short.block_q + 1, _MAX_INT32))
    return out


def _launch(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    cfg: PagedAttentionConfig,
    max_query_len: int,
    query_len_range: tuple[int, int],
) -> None:
    """One launch over the batch, serving the sequences whose query_len lies in query_len_range (inclusive)."""
    num_tokens, num_heads, head_size = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    one_tile_per_seq = max(1, max_query_len) <= cfg.block_q
    split = cfg.num_splits > 1
    if split:
        # partial_out [T, Hq, S, D] fp32, partial_lse [T, Hq, S] fp32: every split of every scheduled row is written.
        part_out = torch.empty(num_tokens, num_heads, cfg.num_splits, head_size, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_tokens, num_heads, cfg.num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out, part_lse = out, out  # never touched without SPLIT_KV
    merge_in_launch = split and cfg.merge_in_launch
    grid_kv = num_kv_heads // cfg.kv_heads_per_program
    counters = arrival_counters(q.device, num_seqs * grid_kv) if merge_in_launch else seq_lens  # else never touched
    fp32_dot = q.dtype == torch.float32 or (INTERPRET and q.dtype == torch.bfloat16)
    # Without one tile per sequence: an upper bound on query tiles (see _find_seq); surplus programs return at once.
    tiles = num_seqs if one_tile_per_seq else num_tokens // cfg.block_q + num_seqs
    grid = (tiles, grid_kv, cfg.num_splits)
    _paged_attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        part_out,
        part_lse,
        counters,
        scale * _LOG2E,
        num_seqs,
        cfg.num_splits,
        *query_len_range,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2) if split else 0,
        part_lse.stride(0),
        part_lse.stride(1),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=cfg.block_q,
        TILE_N=cfg.tile_n,
        KV_HEADS=cfg.kv_heads_per_program,
        KV_HEADS_PADDED=triton.next_power_of_2(cfg.kv_heads_per_program),
        ONE_TILE_PER_SEQ=one_tile_per_seq,
        SPLIT_KV=split,
        MERGE_IN_LAUNCH=merge_in_launch,
        MERGE_SPLITS_PADDED=triton.next_power_of_2(cfg.num_splits),
        MERGE_CHUNK=min(cfg.merge_chunk, triton.next_power_of_2(cfg.num_splits)),
        SPLIT_MIN_TILES=cfg.split_min_tiles,
        SLIDING_WINDOW=sliding_window or 0,
        DOT_PRECISION="ieee" if fp32_dot else "tf32",
        INTERPRET=INTERPRET,
        IDX=tl.int64 if INTERPRET else tl.int32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **dependent_launch(q.device),
    )
    if split and not merge_in_launch:
        merge_attention_partials(
            part_out, part_lse, out, num_valid=query_start_loc[num_seqs:], heads_per_program=cfg.merge_heads_per_program
        )


def _check_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, sliding_window) -> None:
    check_kernel_device(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_size], got {tuple(q.shape)}; view it as (T, Hq, D)")
    check_cache_pair(k_cache, v_cache)
    _, num_heads, head_size = q.shape
    _, _, num_kv_heads, cache_head_size = k_cache.shape
    if cache_head_size != head_size:
        raise ValueError(f"q head_size {head_size} != cache head_size {cache_head_size}; they must match")
    if head_size > _MAX_HEAD_SIZE:
        raise ValueError(f"head_size {head_size} is above the supported {_MAX_HEAD_SIZE}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads} (GQA needs it)")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}: all must be the same one of "
            "float16, bfloat16, float32"
        )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last (head_size) dim, got strides {t.stride()}")
    num_seqs = seq_lens.shape[0]
    for name, t, shape in (
        ("query_start_loc", query_start_loc, (num_seqs + 1,)),
        ("seq_lens", seq_lens, (num_seqs,)),
    ):
        if t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous int32 tensor of shape {shape}, got {t.dtype} {tuple(t.shape)}"
            )
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be int32 [{num_seqs}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous; call .contiguous() on it")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain-PyTorch `paged_attention` in fp32, returned as fp32 [T, Hq, D] (rows of no sequence stay zero).

    Per sequence: gather its KV from the block table, mask causally (and by the window), softmax.
    """
    num_tokens, num_heads, head_size = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[i, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale

        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out
