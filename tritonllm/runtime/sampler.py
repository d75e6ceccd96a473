"""Turns the logits of the rows that sample this step into tokens, and into log-probabilities when asked.

Per row, in vLLM's order: min_tokens bans the stop tokens; repetition, frequency and presence penalties;
temperature; min_p, top_k, top_p; then a greedy argmax or a seeded draw (`tritonllm.kernels.sampling`).
Without filtering the whole chain runs in one kernel pass; with it, the penalties run in a kernel, the
filters in torch (sort-based: they need order statistics of the full row), and the draw in the kernel.

Non-finite logits (an fp16 model that overflowed): NaN counts as -inf in the filters and the draw, so every row
gets a token id in [0, V) (token 0 for a row with nothing above -inf); see `tritonllm.kernels.sampling.sample`.

Log-probabilities are vLLM's default "raw" ones: log_softmax of the model's logits, before min_tokens,
penalties, temperature or filtering, so they describe the model rather than the sampling recipe.
"""

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from tritonllm.kernels.penalties import apply_penalties
from tritonllm.kernels.sampling import sample
from tritonllm.sampling_params import SamplingParams


@dataclass(slots=True)
class LogprobsTensors:
    """Per row: column 0 is the chosen token (the sampled one, or the actual next prompt token), then the
    top-k tokens by log-probability, most likely first. Rows may want fewer than K: slice [:, :k + 1]."""

    token_ids: torch.Tensor  # [N, K + 1] int64
    logprobs: torch.Tensor  # [N, K + 1] float32
    ranks: torch.Tensor  # [N] int64, rank of column 0's token among all tokens: 1 = most likely


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling inputs for one step, as tensors on the logits' device. Build with `build`."""

    temperature: torch.Tensor  # [N] float32, 0 = greedy row
    seeds: torch.Tensor  # [N] int64, Philox key (request seed + sample index); unseeded rows: ignored
    seeded: torch.Tensor  # [N] bool, False = the sampler draws this row's key from the engine's generator
    positions: torch.Tensor  # [N] int64, position of the token being sampled (prompt + output so far)
    all_greedy: bool
    any_unseeded: bool
    top_k: torch.Tensor | None = None  # [N] int64, vocab_size = off; None when no row filters by top_k
    top_p: torch.Tensor | None = None  # [N] float32, 1 = off; None when no row filters by top_p
    min_p: torch.Tensor | None = None  # [N] float32, 0 = off; None when no row filters by min_p
    # Penalties: all five set, or all None when no row penalizes.
    repetition_penalty: torch.Tensor | None = None  # [N] float32
    presence_penalty: torch.Tensor | None = None  # [N] float32
    frequency_penalty: torch.Tensor | None = None  # [N] float32
    prompt_mask: torch.Tensor | None = None  # [N, V] bool, token occurs in the prompt
    output_counts: torch.Tensor | None = None  # [N, V] int32, occurrences in the output so far
    # min_tokens: (row, token) pairs whose logit is set to -inf; None when no row is below min_tokens.
    banned_rows: torch.Tensor | None = None  # [B] int64
    banned_tokens: torch.Tensor | None = None  # [B] int64
    max_num_logprobs: int | None = None  # most top-k logprobs any row wants; None = no row wants any

    @property
    def penalties(self) -> tuple[torch.Tensor, ...] | None:
        if self.prompt_mask is None:
            return None
        return (
            self.prompt_mask,
            self.output_counts,
            self.repetition_penalty,
            self.presence_penalty,
            self.frequency_penalty,
        )

    @property
    def needs_filtering(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        token_ids: Sequence[Sequence[int]],
        num_prompt_tokens: Sequence[int],
        vocab_size: int,
        *,
        eos_token_id: int | Collection[int] | None = None,
        sample_indices: Sequence[int] | None = None,
        num_pending: Sequence[int] | None = None,
        pending_token_ids: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> "SamplingMetadata":
        """One row per entry: its request's params and token ids so far, the first num_prompt_tokens of them the
        prompt, the rest output (the token being sampled comes next). The lists are only read, and sliced only
        for rows with penalties. sample_indices: which of the request's n samples each row is (seeded rows use
        seed + index, as vLLM does). eos_token_id (one id or several, as Llama 3 lists) joins the stop tokens that
        min_tokens bans (unless ignore_eos). num_pending: output tokens each row has beyond its list, sampled by a
        step still running (asynchronous scheduling), at most one; pending_token_ids: those tokens on `device`, one
        per row with one pending, in row order (penalties count them; only needed when a row has penalties)."""
        n = len(params)
        if not len(token_ids) == len(num_prompt_tokens) == n:
            raise ValueError(
                f"one token list and one prompt length per row: got {n} params, {len(token_ids)} token lists, "
                f"{len(num_prompt_tokens)} prompt lengths"
            )
        sample_indices = list(sample_indices) if sample_indices is not None else [0] * n
        pending = list(num_pending) if num_pending is not None else [0] * n
        if any(k > 1 for k in pending):
            raise ValueError(f"a row has at most one token pending, got num_pending={pending}")
        pending_rows = [r for r, k in enumerate(pending) if k]
        penalized_pending = any(params[r].has_penalties for r in pending_rows)
        if penalized_pending and (pending_token_ids is None or pending_token_ids.shape != (len(pending_rows),)):
            raise ValueError(
                f"penalties count every output token: pass pending_token_ids, one per pending row "
                f"({len(pending_rows)}), got {None if pending_token_ids is None else tuple(pending_token_ids.shape)}"
            )
        lengths = [len(t) + k for t, k in zip(token_ids, pending, strict=True)]  # the sampled token's position
        greedy = [p.is_greedy for p in params]

        pinned = torch.device(device).type == "cuda"

        def row_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            # Pinned + non_blocking: a pageable copy would wait here for the forward pass still running.
            return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=pinned)

        # Any Python int becomes a 64-bit key, stored as the signed int64 with the same bits.
        keys = [((p.seed or 0) + i) % 2**64 for p, i in zip(params, sample_indices, strict=True)]
        meta = cls(
            temperature=row_tensor(
                [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], torch.float32
            ),
            seeds=row_tensor([k - 2**64 if k >= 2**63 else k for k in keys], torch.int64),
            seeded=row_tensor([p.seed is not None for p in params], torch.bool),
            positions=row_tensor(lengths, torch.int64),
            all_greedy=all(greedy),
            any_unseeded=any(p.seed is None and not g for p, g in zip(params, greedy, strict=True)),
        )
        if any(p.top_k > 0 for p in params):
            meta.top_k = row_tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64)
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = row_tensor([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in params):
            meta.min_p = row_tensor([p.min_p for p in params], torch.float32)

        if any(p.has_penalties for p in params):
            meta.repetition_penalty = row_tensor([p.repetition_penalty for p in params], torch.float32)
            meta.presence_penalty = row_tensor([p.presence_penalty for p in params], torch.float32)
            meta.frequency_penalty = row_tensor([p.frequency_penalty for p in params], torch.float32)
            meta.prompt_mask = torch.zeros((n, vocab_size), dtype=torch.bool, device=device)
            meta.output_counts = torch.zeros((n, vocab_size), dtype=torch.int32, device=device)
            # Rows without penalties are never read by the kernel: skip their tokens.
            rows = [r for r, p in enumerate(params) if p.has_penalties]
            prompt_rows, prompt_toks = _pairs(rows, [token_ids[r][: num_prompt_tokens[r]] for r in rows])
            meta.prompt_mask[prompt_rows.to(device), prompt_toks.to(device)] = True
            out_rows, out_toks = _pairs(rows, [token_ids[r][num_prompt_tokens[r] :] for r in rows])
            ones = torch.ones(out_rows.numel(), dtype=torch.int32, device=device)
            meta.output_counts.index_put_((out_rows.to(device), out_toks.to(device)), ones, accumulate=True)
            if penalized_pending:  # the tokens still on the device count too (rows without penalties are not read)
                ones = torch.ones(len(pending_rows), dtype=torch.int32, device=device)
                rows = row_tensor(pending_rows, torch.int64)
                meta.output_counts.index_put_((rows, pending_token_ids.to(device)), ones, accumulate=True)

        banned = [
            (r, t)
            for r, p in enumerate(params)
            if p.min_tokens and lengths[r] - num_prompt_tokens[r] < p.min_tokens
            for t in sorted(p.stop_token_set(eos_token_id))
            if t < vocab_size
        ]
        if banned:
            meta.banned_rows = row_tensor([r for r, _ in banned], torch.int64)
            meta.banned_tokens = row_tensor([t for _, t in banned], torch.int64)

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        meta.max_num_logprobs = min(max(wanted), vocab_size) if wanted else None
        return meta


def _pairs(rows: list[int], token_lists: list[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    row_ids = [r for r, toks in zip(rows, token_lists, strict=True) for _ in toks]
    tokens = [t for toks in token_lists for t in toks]
    return torch.tensor(row_ids, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int64)


class Sampler:
    """Samples one token per row. Rows without a seed get a fresh 64-bit key per step from a generator
    seeded once with the engine seed, so a whole run is reproducible given the engine seed."""

    def __init__(self, seed: int = 0):
        self._generator = torch.Generator().manual_seed(seed)

    def warm_up(self, vocab_size: int, device: torch.device | str) -> None:
        """Compile the draw's kernels for this vocab now, greedy and seeded rows without penalties (what most steps
        run), so the first requests do not wait on the compiler. The engine's generator is left untouched: a run
        samples the same tokens with or without a warm-up."""
        logits = torch.linspace(-1.0, 1.0, vocab_size, device=device)[None]  # no random stream is drawn from
        sample(logits, None)
        seed_and_position = torch.zeros(1, dtype=torch.int64, device=device)
        sample(logits, torch.ones(1, device=device), seed_and_position, seed_and_position)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits [N, V] float32, one row per metadata row. Returns SamplerOutput (tokens [N] int64)."""
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError(f"logits must be a [N, V] float32 tensor, got {tuple(logits.shape)} {logits.dtype}")
        if logits.shape[0] != metadata.temperature.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows but sampling metadata for {metadata.temperature.shape[0]}")
        logits = logits.contiguous()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if metadata.max_num_logprobs is not None else None

        if metadata.banned_rows is not None:
            logits = logits.clone()
            logits[metadata.banned_rows, metadata.banned_tokens] = float("-inf")
        seeds = metadata.seeds
        if metadata.any_unseeded:
            drawn = torch.randint(-(2**63), 2**63 - 1, seeds.shape, generator=self._generator, dtype=torch.int64)
            seeds = torch.where(metadata.seeded, seeds, drawn.to(seeds.device))

        penalties = metadata.penalties
        if metadata.all_greedy:
            tokens = sample(logits, None, None, None, *(penalties or ()))
        elif not metadata.needs_filtering:
            tokens = sample(logits, metadata.temperature, seeds, metadata.positions, *(penalties or ()))
        else:
            if penalties is not None:
                logits = apply_penalties(logits, *penalties)
            sampled = metadata.temperature > 0
            logits = logits / torch.where(sampled, metadata.temperature, 1.0)[:, None]
            # NaN ranks last, as in the draw: left in, it makes softmax and the k-th largest logit NaN.
            logits = logits.masked_fill(logits.isnan(), float("-inf"))
            if metadata.min_p is not None:
                logits = apply_min_p(logits, metadata.min_p)
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
            # Already scaled: temperature 1 for sampled rows, 0 keeps greedy rows greedy.
            tokens = sample(logits, sampled.float(), seeds, metadata.positions)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, tokens)
        return SamplerOutput(sampled_token_ids=tokens, logprobs=logprobs)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability. logits [N, V], min_p [N]."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's sort-based filter. top_k keeps tokens >= the k-th largest logit (ties kept); top_p then keeps the
    smallest most-likely set whose probability reaches p (always at least one token). logits [N, V]."""
    if k is None and p is None:
        return logits
    ascending, order = logits.sort(dim=-1)
    if k is not None:
        kth = ascending.gather(1, (ascending.shape[1] - k.clamp(1, ascending.shape[1]))[:, None])
        ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    if p is not None:
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - p[:, None]
        drop[:, -1] = False
        ascending = ascending.masked_fill(drop, float("-inf"))
    return ascending.scatter(1, order, ascending)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """Column 0: token_ids and their logprobs and ranks; then the top num_logprobs per row.
    logprobs [N, V] float32 (normalized); token_ids [N] int64."""
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([token_ids[:, None], top_ids], dim=1),
        logprobs=torch.cat([chosen, top_logprobs], dim=1),
        ranks=ranks,
    )


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Logprobs of the actual prompt tokens: logits [P, V] at prompt positions i, next_token_ids [P] the prompt
    tokens at i + 1. Raw logprobs (log_softmax of the logits), like the sampled ones."""
    if logits.dim() != 2 or next_token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"logits must be [P, V] and next_token_ids [P], got {tuple(logits.shape)} and {tuple(next_token_ids.shape)}"
        )
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return gather_logprobs(logprobs, min(num_logprobs, logits.shape[1]), next_token_ids.long())
