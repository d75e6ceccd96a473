"""Second stage of split-KV (flash-decoding) attention: merge per-split partial outputs into the output.

Split s of a query row attended over its own slice of the keys and left o_s (softmax-normalised over that slice)
and lse_s = log(sum of exp(scores) over the slice). The full softmax is the lse-weighted mix of the slices:
out = sum_s exp(lse_s - lse) o_s with lse = log(sum_s exp(lse_s)). An empty slice has lse_s = -inf, weight 0.

Two ways to run it: `merge_attention_partials`, a launch of its own after the attention kernel, or
`merge_splits_in_launch`, called by the attention kernel itself, where the last of a tile's split programs to
finish merges (no second launch: at batch 1 that launch costs about as much as the merge's work).
"""

import torch
import triton
import triton.language as tl

from tritonllm.kernels.dependent_launch import dependent_launch, wait_for_previous_kernel
from tritonllm.platform import check_kernel_device


@triton.jit
def _merge_attention_partials_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_valid_ptr,
    num_heads,
    num_splits,
    stride_out_t,
    stride_out_h,
    stride_po_t,
    stride_po_h,
    stride_po_s,
    stride_pl_t,
    stride_pl_h,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    HAS_NUM_VALID: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0)
    offs_h = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    offs_s = tl.arange(0, SPLITS_PADDED)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    h_valid = offs_h < num_heads
    hs_valid = h_valid[:, None] & (offs_s[None, :] < num_splits)

    t64 = token.to(tl.int64)
    lse_offs = t64 * stride_pl_t + offs_h[:, None] * stride_pl_h + offs_s[None, :]
    lse = tl.load(part_lse_ptr + lse_offs, mask=hs_valid, other=float("-inf"))  # [H, S]
    lse_max = tl.max(lse, axis=1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no visible key at all: weights 0, output 0
    w = tl.exp2((lse - lse_max[:, None]) * 1.4426950408889634)  # [H, S], exp via exp2: x * log2(e)

    o_offs = (
        t64 * stride_po_t
        + offs_h[:, None, None] * stride_po_h
        + offs_s[None, :, None] * stride_po_s
        + offs_d[None, None, :]
    )
    o_mask = hs_valid[:, :, None] & (offs_d[None, None, :] < HEAD_SIZE)
    o = tl.load(part_out_ptr + o_offs, mask=o_mask, other=0.0)  # [H, S, D] fp32
    den = tl.sum(w, axis=1)
    out = tl.sum(w[:, :, None] * o, axis=1) / tl.where(den == 0.0, 1.0, den)[:, None]

    out_offs = t64 * stride_out_t + offs_h[:, None] * stride_out_h + offs_d[None, :]
    out_mask = h_valid[:, None] & (offs_d[None, :] < HEAD_SIZE)
    if HAS_NUM_VALID:
        # A padding row past the scheduled tokens is left as the caller gave it. Checked at the store, not with an
        # early exit, so the partials' loads need not wait for this one (a padding row's partials are only read).
        # The token as a [1, 1] tensor: the interpreter rejects a scalar operand in a mask.
        out_mask = out_mask & (tl.full([1, 1], token, tl.int32) < tl.load(num_valid_ptr))
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def merge_splits_in_launch(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    token,
    q_head,
    offs_d,
    row_valid,
    own,
    num_splits,
    stride_out_t,
    stride_out_h,
    stride_po_t,
    stride_po_h,
    stride_po_s,
    stride_pl_t,
    stride_pl_h,
    SPLITS_PADDED: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Called by each split program of one tile after storing its partials: the last to arrive (counted at
    `counter_ptr`, acq_rel at GPU scope after a CTA barrier, so every thread's stores precede the count) merges the
    tile's rows and sets the counter back to 0. Partials are read with .cg: from L2, past the SM's non-coherent L1,
    where the other programs' stores are. All splits' LSEs load at once; outputs CHUNK splits at a time, so a
    merge of many splits waits on a few round trips to L2, not one per split."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:
        lse_rows = part_lse_ptr + token * stride_pl_t + q_head * stride_pl_h  # [BLOCK_M] row starts
        offs_s = tl.arange(0, SPLITS_PADDED)
        lse_mask = row_valid[:, None] & (offs_s[None, :] < num_splits)
        lse = tl.load(lse_rows[:, None] + offs_s[None, :], mask=lse_mask, other=float("-inf"), cache_modifier=".cg")
        lse_max = tl.max(lse, axis=1)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no visible key at all: weights 0, output 0
        den = tl.sum(tl.exp2((lse - lse_max[:, None]) * 1.4426950408889634), axis=1)

        offs_c = tl.arange(0, CHUNK)
        po_rows = part_out_ptr + token * stride_po_t + q_head * stride_po_h  # [BLOCK_M]
        acc = tl.zeros(own.shape, dtype=tl.float32)
        for s0 in range(0, num_splits, CHUNK):
            in_range = (s0 + offs_c) < num_splits  # [CHUNK]
            w_mask = row_valid[:, None] & in_range[None, :]
            lse_c = tl.load(lse_rows[:, None] + s0 + offs_c[None, :], mask=w_mask, other=float("-inf"),
                            cache_modifier=".cg")  # fmt: skip
            w = tl.exp2((lse_c - lse_max[:, None]) * 1.4426950408889634)  # [BLOCK_M, CHUNK]
            o_ptrs = po_rows[:, None, None] + (s0 + offs_c)[None, :, None] * stride_po_s + offs_d[None, None, :]
            o = tl.load(o_ptrs, mask=own[:, None, :] & in_range[None, :, None], other=0.0, cache_modifier=".cg")
            acc += tl.sum(w[:, :, None] * o, axis=1)
        merged = acc / tl.where(den == 0.0, 1.0, den)[:, None]
        out_offs = token[:, None] * stride_out_t + q_head[:, None] * stride_out_h + offs_d[None, :]
        tl.store(out_ptr + out_offs, merged.to(out_ptr.dtype.element_ty), mask=own)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


def merge_attention_partials(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    out: torch.Tensor,
    num_valid: torch.Tensor | None = None,
    heads_per_program: int = 1,
) -> torch.Tensor:
    """out[t, h] = sum_s softmax_s(partial_lse[t, h, :]) * partial_out[t, h, s] (splits with lse -inf weigh 0).

    partial_out: [T, H, S, D] fp32, last dim contiguous; each split's output normalised over its own keys
    partial_lse: [T, H, S] fp32, last dim contiguous; natural-log sum of exp(scores) of each split, -inf if empty
    out:         [T, H, D] fp16/bf16/fp32, last dim contiguous; written in place and returned
    num_valid:   optional int32 [1] on the device (e.g. query_start_loc[-1:]); rows t >= num_valid[0] untouched
    heads_per_program: heads merged per program, a power of two (more per program: fewer, larger programs)
    A row whose splits are all empty gets zeros.
    """
    check_kernel_device(partial_out, partial_lse, out, *([] if num_valid is None else [num_valid]))
    if partial_out.dim() != 4 or partial_out.dtype != torch.float32 or partial_out.stride(-1) != 1:
        raise ValueError(
            f"partial_out must be fp32 [T, H, S, D] with a contiguous last dim, got {partial_out.dtype} "
            f"{tuple(partial_out.shape)} strides {partial_out.stride()}"
        )
    num_tokens, num_heads, num_splits, head_size = partial_out.shape
    if partial_lse.shape != (num_tokens, num_heads, num_splits) or partial_lse.dtype != torch.float32:
        raise ValueError(
            f"partial_lse must be fp32 {(num_tokens, num_heads, num_splits)} to match partial_out, got "
            f"{partial_lse.dtype} {tuple(partial_lse.shape)}"
        )
    if partial_lse.stride(-1) != 1:
        raise ValueError("partial_lse needs a contiguous last (split) dim; call .contiguous() on it")
    if out.shape != (num_tokens, num_heads, head_size) or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {(num_tokens, num_heads, head_size)} with a contiguous last dim, got {tuple(out.shape)} "
            f"strides {out.stride()}"
        )
    if out.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"out must be float16, bfloat16 or float32, got {out.dtype}")
    if num_valid is not None and (num_valid.dtype != torch.int32 or num_valid.numel() != 1):
        raise ValueError(f"num_valid must be an int32 tensor of one element, got {num_valid.dtype} {num_valid.shape}")
    if heads_per_program < 1 or heads_per_program & (heads_per_program - 1):
        raise ValueError(f"heads_per_program must be a power of two, got {heads_per_program}")
    if num_tokens == 0 or num_heads == 0:
        return out
    grid = (num_tokens, triton.cdiv(num_heads, heads_per_program))
    _merge_attention_partials_kernel[grid](
        out,
        partial_out,
        partial_lse,
        partial_lse if num_valid is None else num_valid,  # never read without HAS_NUM_VALID
        num_heads,
        num_splits,
        out.stride(0),
        out.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        SPLITS_PADDED=triton.next_power_of_2(num_splits),
        HEADS_PER_PROGRAM=heads_per_program,
        HAS_NUM_VALID=num_valid is not None,
        num_warps=4,
        **dependent_launch(out.device),
    )
    return out


def merge_attention_partials_ref(partial_out: torch.Tensor, partial_lse: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch `merge_attention_partials`, fp32 [T, H, D]: a softmax over splits weighs their outputs."""
    lse = partial_lse.float()
    all_empty = torch.isneginf(lse).all(dim=-1, keepdim=True)
    weights = torch.where(all_empty, torch.zeros_like(lse), lse).softmax(dim=-1)
    weights = torch.where(all_empty, torch.zeros_like(weights), weights)
    return torch.einsum("ths,thsd->thd", weights, partial_out.float())
