"""Per-row sampling: penalties (fused from `penalties.py`), temperature, and a seeded exponential race.

Exponential race (Gumbel-max): with E_v ~ Exp(1) independent per token, argmax_v p_v / E_v is distributed as
p. Taking logs, argmax_v p_v / E_v = argmax_v (logit_v / T - log E_v) since log p_v = logit_v / T - log Z and
log Z is the same for every v. The log form needs no softmax, so one pass over a tile suffices. A program
owns a [BLOCK_ROWS, BLOCK_V] tile: big vocabs are split into several tiles per row that each report their
best (score, token), and a second tiny kernel picks each row's winner; small vocabs stack rows in one tile.

Top-k / top-p / min-p are not here: they need order statistics of the whole processed row (a sort or a
selection), which a streaming pass cannot give. The sampler applies them in torch (sort-based) to the
penalized, temperature-scaled logits and then calls `sample` on the filtered logits with T = 1.

Noise: E for (row, token v) comes from `tl.rand(seed, offset)` with offset = position << 32 | v, i.e. Philox
keyed by the request's 64-bit seed with the counter (v, position). A token's noise therefore depends only on
(seed, position, v): the same request samples the same token whatever else is in the batch, however the
vocab is tiled, and again after preemption and recompute. Distinct positions use disjoint counters, so
they never share noise.

E = -log(1 - U) keeps full relative precision where it matters: small E decides the winner in flat
distributions over big vocabs (the winner's E is about 1/V), and both -log(U) (U rounds to float32's grid
just below 1) and a log near 1 (tl.log is lg2.approx on NVIDIA GPUs, accurate in absolute terms only)
would lose it. So E comes from the series u + u^2/2 + u^3/3 + u^4/4 for u < 1/64 and from -log(1 - u) above.
"""

import math

import torch
import triton
import triton.language as tl

from tritonllm.kernels.penalties import (
    apply_penalties_ref,
    check_logits,
    check_penalties,
    check_row_param,
    launch_config,
    penalized_tile,
)
from tritonllm.platform import check_kernel_device

# Half a step of tl.rand's 2^-31 grid: keeps U > 0 so E > 0 and no token gets an infinite score.
HALF_STEP = tl.constexpr(2.0**-32)


# N (rows this step) is left unspecialized: with a vocab past one tile (every real model's) no constexpr depends on
# it either, so one compiled variant serves every batch size (see paged_attention.py).
@triton.jit(do_not_specialize=["N"])
def _sample_kernel(
    logits_ptr, temperature_ptr, seeds_ptr, positions_ptr,
    prompt_mask_ptr, output_counts_ptr, repetition_ptr, presence_ptr, frequency_ptr,
    tile_scores_ptr, tile_tokens_ptr, out_ptr,
    N, V, NUM_TILES, stride_logits_row, stride_prompt_mask_row, stride_output_counts_row,
    BLOCK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr, HAS_PENALTIES: tl.constexpr, ALL_GREEDY: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    tile = tl.program_id(1)
    offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < N
    col_mask = offs < V
    scores = penalized_tile(
        logits_ptr, prompt_mask_ptr, output_counts_ptr, repetition_ptr, presence_ptr, frequency_ptr, rows, offs,
        row_mask, col_mask, stride_logits_row, stride_prompt_mask_row, stride_output_counts_row, HAS_PENALTIES,
    )  # fmt: skip
    if not ALL_GREEDY:
        temperature = tl.load(temperature_ptr + rows, mask=row_mask, other=0.0)[:, None]
        seeds = tl.load(seeds_ptr + rows, mask=row_mask, other=0)[:, None]
        positions = tl.load(positions_ptr + rows, mask=row_mask, other=0)[:, None] & 0xFFFFFFFF
        # Philox keyed by each row's seed, counter (v, position): tl.rand broadcasts a [rows, 1] key.
        u = tl.rand(seeds, (positions << 32) | offs[None, :].to(tl.int64)) + HALF_STEP
        # E = -log(1 - u): a series where u is small (truncation error < u^4 / 5), the log elsewhere.
        series = u * (1.0 + u * (0.5 + u * (0.3333333333333333 + u * 0.25)))
        exp_noise = tl.where(u < 0.015625, series, -tl.log(1.0 - u))
        sampled = temperature > 0
        inv_temperature = tl.where(sampled, 1.0 / tl.where(sampled, temperature, 1.0), 1.0)
        scores = tl.where(sampled, scores * inv_temperature - tl.log(exp_noise), scores)
    # NaN (scores != scores) counts as -inf: compiled argmax compares with `>`, so a NaN would lose to anything,
    # padding columns past V included, and its row could return a token >= V. With no NaN left, ties (an all -inf
    # row) go to the lowest column, which every tile has below V.
    scores = tl.where(col_mask[None, :] & (scores == scores), scores, float("-inf"))
    best_score, best_index = tl.max(scores, axis=1, return_indices=True)
    tokens = tile * BLOCK_V + best_index
    if SINGLE_TILE:
        tl.store(out_ptr + rows, tokens.to(tl.int64), mask=row_mask)
    else:
        tl.store(tile_scores_ptr + rows * NUM_TILES + tile, best_score, mask=row_mask)
        tl.store(tile_tokens_ptr + rows * NUM_TILES + tile, tokens, mask=row_mask)


@triton.jit(do_not_specialize=["N"])
def _pick_tile_kernel(tile_scores_ptr, tile_tokens_ptr, out_ptr, N, NUM_TILES, BLOCK_ROWS: tl.constexpr,
                      BLOCK_TILES: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs = tl.arange(0, BLOCK_TILES)
    mask = (rows < N)[:, None] & (offs < NUM_TILES)[None, :]
    index = rows[:, None] * NUM_TILES + offs[None, :]
    scores = tl.load(tile_scores_ptr + index, mask=mask, other=float("-inf"))
    # Ties go to the lowest tile, so ties in the row go to the lowest token id (like torch.argmax).
    _, best_tile = tl.max(scores, axis=1, return_indices=True)
    tokens = tl.load(tile_tokens_ptr + rows * NUM_TILES + best_tile, mask=rows < N, other=0)
    tl.store(out_ptr + rows, tokens.to(tl.int64), mask=rows < N)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
    repetition_penalty: torch.Tensor | None = None,
    presence_penalty: torch.Tensor | None = None,
    frequency_penalty: torch.Tensor | None = None,
    *,
    block_v: int | None = None,
) -> torch.Tensor:
    """One token per row: the argmax of the (penalized) logits where temperature <= 0, else a seeded sample.

    x = penalized logits (see `tritonllm.kernels.penalties.apply_penalties`; the five penalty arguments are
    all given or all None).
    Greedy row (temperature[r] <= 0, or temperature None for all rows): token = argmax_v x[v] (ties: lowest id).
    Sampled row: token = argmax_v (x[v] / T - log E_v), E_v ~ Exp(1) from Philox keyed by seeds[r] at counter
    (v, positions[r] mod 2^32): a draw from softmax(x / T) that depends only on (seed, position, x).
    Non-finite logits: NaN counts as -inf (penalties and temperature are applied first). Tokens at -inf are never
    drawn while the row has any other; a row with +inf tokens gives the lowest of them (sampled rows too); a row
    with nothing above -inf (all NaN / -inf) gives token 0. The result is always in [0, V).

    logits [N, V] fp16/bf16/fp32 (rows contiguous); temperature [N] float32 or None (all greedy: no noise is
    computed, seeds and positions may be None); seeds [N] int64 (any 64-bit pattern); positions [N] int64
    (the sampled token's position in its sequence). block_v overrides the vocab tile width (a power of two;
    the result does not depend on it). Returns [N] int64.
    """
    check_logits(logits)
    n, v = logits.shape
    all_greedy = temperature is None
    if not all_greedy:
        if seeds is None or positions is None:
            raise ValueError("sampling with a temperature needs seeds and positions (pass temperature=None for greedy)")
        check_row_param("temperature", temperature, n, torch.float32)
        check_row_param("seeds", seeds, n, torch.int64)
        check_row_param("positions", positions, n, torch.int64)
        check_kernel_device(temperature, seeds, positions)
    penalties = (prompt_mask, output_counts, repetition_penalty, presence_penalty, frequency_penalty)
    has_penalties = prompt_mask is not None
    if any((p is None) == has_penalties for p in penalties):
        raise ValueError(
            "pass all of prompt_mask, output_counts, repetition_penalty, presence_penalty, frequency_penalty, "
            "or none of them"
        )
    if has_penalties:
        check_penalties(logits, *penalties)
    if v == 0:
        raise ValueError("logits have an empty vocab dimension; there is no token to sample")
    if block_v is not None and (block_v < 1 or block_v & (block_v - 1)):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    check_kernel_device(logits)

    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    block_rows, block_v = launch_config(n, v, block_v)
    num_tiles = triton.cdiv(v, block_v)
    tile_scores = torch.empty((n, num_tiles), dtype=torch.float32, device=logits.device)
    tile_tokens = torch.empty((n, num_tiles), dtype=torch.int32, device=logits.device)
    # Pointer slots that a constexpr switch leaves unread take any tensor.
    temperature, seeds, positions = (logits, logits, logits) if all_greedy else (temperature, seeds, positions)
    if has_penalties:
        pm, oc, rep, pres, freq = prompt_mask.view(torch.uint8), *penalties[1:]
        stride_pm, stride_oc = prompt_mask.stride(0), output_counts.stride(0)
    else:
        pm = oc = rep = pres = freq = logits
        stride_pm = stride_oc = 0
    grid = (triton.cdiv(n, block_rows), num_tiles)
    _sample_kernel[grid](
        logits, temperature, seeds, positions, pm, oc, rep, pres, freq, tile_scores, tile_tokens, out,
        n, v, num_tiles, logits.stride(0), stride_pm, stride_oc,
        BLOCK_ROWS=block_rows, BLOCK_V=block_v, HAS_PENALTIES=has_penalties, ALL_GREEDY=all_greedy,
        SINGLE_TILE=num_tiles == 1,
    )  # fmt: skip
    if num_tiles > 1:
        block_tiles = triton.next_power_of_2(num_tiles)
        pick_rows = max(1, 1024 // block_tiles)  # whatever n is: one variant for every batch size
        _pick_tile_kernel[(triton.cdiv(n, pick_rows),)](
            tile_scores, tile_tokens, out, n, num_tiles, BLOCK_ROWS=pick_rows, BLOCK_TILES=block_tiles
        )
    return out


# --------------------------------------------------------------------------------------------------------------
# References (plain PyTorch, float32, one row at a time).
# --------------------------------------------------------------------------------------------------------------


def sample_probs_ref(
    logits: torch.Tensor, temperature: torch.Tensor, penalties: tuple[torch.Tensor, ...] | None = None
) -> torch.Tensor:
    """The distribution `sample` draws from: softmax(penalized / T), or a one-hot argmax where T <= 0.

    NaN counts as -inf; a row with +inf logits puts all its mass on the lowest +inf token, a row with nothing
    above -inf on token 0 (as `sample` does)."""
    x = apply_penalties_ref(logits, *penalties) if penalties is not None else logits.float()
    probs = torch.empty_like(x)
    for r in range(x.shape[0]):
        t = temperature[r].item()
        row = x[r] / t if t > 0 else x[r]
        row = torch.where(row.isnan(), float("-inf"), row)
        top = row.max()
        if t > 0 and math.isfinite(top.item()):
            probs[r] = torch.softmax(row, dim=0)
        else:
            # argmax: the first maximal token, so the first +inf token, or token 0 if all are -inf.
            probs[r] = torch.nn.functional.one_hot(row.argmax(), x.shape[1]).float()
    return probs


def sample_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    penalties: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """A sample from the same distribution as `sample`, drawn with torch's generator seeded by (seed, position).

    Greedy rows match `sample` exactly; sampled rows match it in distribution (the random streams differ).
    """
    probs = sample_probs_ref(logits, temperature, penalties)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    for r in range(logits.shape[0]):
        if temperature[r].item() > 0:
            g = torch.Generator().manual_seed((int(seeds[r]) * 1_000_003 + int(positions[r])) % 2**63)
            race = probs[r].cpu() / torch.empty(probs.shape[1]).exponential_(generator=g)
            tokens[r] = race.argmax()
        else:
            tokens[r] = probs[r].argmax()
    return tokens.to(logits.device)
