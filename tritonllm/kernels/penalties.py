"""Repetition, presence and frequency penalties on a tile of logits, as vLLM applies them.

`penalized_tile` is shared with the sampling kernel (which fuses it into the draw); `apply_penalties` is
the standalone pass the sampler runs when top-k/top-p/min-p need the penalized row first. The tile-shape
heuristics and input checks shared by both kernels live here too.
"""

import torch
import triton
import triton.language as tl

from tritonllm.platform import INTERPRET, check_kernel_device


@triton.jit
def penalized_tile(
    logits_ptr, prompt_mask_ptr, output_counts_ptr, repetition_ptr, presence_ptr, frequency_ptr, rows, offs,
    row_mask, col_mask, stride_logits_row, stride_prompt_mask_row, stride_output_counts_row,
    HAS_PENALTIES: tl.constexpr,
):  # fmt: skip
    """A [BLOCK_ROWS, BLOCK_V] tile of logits in fp32, penalized in vLLM's order when HAS_PENALTIES:
    repetition (tokens in the prompt or output), then frequency and presence (tokens in the output)."""
    mask = row_mask[:, None] & col_mask[None, :]
    logits = tl.load(logits_ptr + rows[:, None] * stride_logits_row + offs[None, :], mask=mask, other=float("-inf"))
    logits = logits.to(tl.float32)
    if HAS_PENALTIES:
        repetition = tl.load(repetition_ptr + rows, mask=row_mask, other=1.0)[:, None]
        presence = tl.load(presence_ptr + rows, mask=row_mask, other=0.0)[:, None]
        frequency = tl.load(frequency_ptr + rows, mask=row_mask, other=0.0)[:, None]
        # Rows without penalties never read their two [V] rows of counts.
        penalized = (repetition != 1.0) | (presence != 0.0) | (frequency != 0.0)
        pmask = mask & penalized
        in_prompt = tl.load(
            prompt_mask_ptr + rows[:, None] * stride_prompt_mask_row + offs[None, :], mask=pmask, other=0
        )
        counts = tl.load(
            output_counts_ptr + rows[:, None] * stride_output_counts_row + offs[None, :], mask=pmask, other=0
        )
        in_output = counts > 0
        repeated = tl.where(logits > 0, logits / repetition, logits * repetition)
        logits = tl.where((in_prompt != 0) | in_output, repeated, logits)
        logits = logits - frequency * counts.to(tl.float32) - presence * in_output.to(tl.float32)
    return logits


@triton.jit(do_not_specialize=["N"])  # one variant for every batch size (see sampling.py)
def _apply_penalties_kernel(
    logits_ptr, prompt_mask_ptr, output_counts_ptr, repetition_ptr, presence_ptr, frequency_ptr, out_ptr,
    N, V, stride_logits_row, stride_prompt_mask_row, stride_output_counts_row, stride_out_row,
    BLOCK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < N
    col_mask = offs < V
    logits = penalized_tile(
        logits_ptr, prompt_mask_ptr, output_counts_ptr, repetition_ptr, presence_ptr, frequency_ptr, rows, offs,
        row_mask, col_mask, stride_logits_row, stride_prompt_mask_row, stride_output_counts_row, True,
    )  # fmt: skip
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out_row + offs[None, :], logits, mask=out_mask)


def launch_config(num_rows: int, vocab_size: int, block_v: int | None = None) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_V): a tile of about TILE elements; big vocabs get one row per program and several
    tiles per row so a small decode batch still spreads over the SMs; small vocabs stack rows instead.
    The interpreter pays per program and per op, not per element, so it takes much bigger tiles."""
    tile = 1 << 16 if INTERPRET else 4096
    if block_v is None:
        block_v = min(triton.next_power_of_2(vocab_size), tile)
    block_rows = min(triton.next_power_of_2(max(num_rows, 1)), max(1, tile // block_v))
    return block_rows, block_v


def check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab_size], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"logits must be float16, bfloat16 or float32, got {logits.dtype}")
    if logits.shape[1] > 0 and logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous (stride 1 along the vocab); call .contiguous()")


def check_row_param(name: str, t: torch.Tensor, num_rows: int, dtype: torch.dtype) -> None:
    if t.shape != (num_rows,) or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous [{num_rows}] {dtype} tensor (one per logits row), "
            f"got shape {tuple(t.shape)} {t.dtype}"
        )


def check_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> None:
    n, v = logits.shape
    for name, t, dtype in (("prompt_mask", prompt_mask, torch.bool), ("output_counts", output_counts, torch.int32)):
        if t.shape != (n, v) or t.dtype != dtype or (v > 0 and t.stride(1) != 1):
            raise ValueError(
                f"{name} must be a [{n}, {v}] {dtype} tensor with contiguous rows (same shape as logits), "
                f"got shape {tuple(t.shape)} {t.dtype}"
            )
    check_row_param("repetition_penalty", repetition_penalty, n, torch.float32)
    check_row_param("presence_penalty", presence_penalty, n, torch.float32)
    check_row_param("frequency_penalty", frequency_penalty, n, torch.float32)
    check_kernel_device(prompt_mask, output_counts, repetition_penalty, presence_penalty, frequency_penalty)


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """Penalized logits, out of place, in float32.

    For row r and token v, with c = output_counts[r, v] and seen = prompt_mask[r, v] or c > 0:
        x = logits[r, v]
        x = x / rep[r] if seen and x > 0 else x * rep[r] if seen else x
        x = x - freq[r] * c - pres[r] * (c > 0)

    logits [N, V] fp16/bf16/fp32 (rows contiguous); prompt_mask [N, V] bool (token occurs in the prompt);
    output_counts [N, V] int32 (occurrences in the output so far); the three penalties [N] float32.
    Returns [N, V] float32.
    """
    check_logits(logits)
    check_penalties(logits, prompt_mask, output_counts, repetition_penalty, presence_penalty, frequency_penalty)
    check_kernel_device(logits)
    n, v = logits.shape
    out = torch.empty((n, v), dtype=torch.float32, device=logits.device)
    if n == 0 or v == 0:
        return out
    block_rows, block_v = launch_config(n, v)
    grid = (triton.cdiv(n, block_rows), triton.cdiv(v, block_v))
    _apply_penalties_kernel[grid](
        logits, prompt_mask.view(torch.uint8), output_counts, repetition_penalty, presence_penalty,
        frequency_penalty, out, n, v, logits.stride(0), prompt_mask.stride(0), output_counts.stride(0),
        out.stride(0), BLOCK_ROWS=block_rows, BLOCK_V=block_v,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, float32, one row at a time).
# --------------------------------------------------------------------------------------------------------------


def apply_penalties_ref(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    out = logits.float().clone()
    for r in range(out.shape[0]):
        x = out[r]
        counts = output_counts[r].float()
        seen = prompt_mask[r] | (counts > 0)
        rep = repetition_penalty[r].item()
        x[seen] = torch.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
        x -= frequency_penalty[r].item() * counts
        x -= presence_penalty[r].item() * (counts > 0).float()
    return out
