"""How one request samples and when it stops: the user-facing knobs, validated once at construction."""

import enum
from collections.abc import Iterable
from dataclasses import dataclass

# Below this temperature a request samples greedily (as vLLM does): logits / 1e-6 only overflows.
GREEDY_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class RequestOutputKind(enum.Enum):
    """When the engine reports a request (vLLM's names): after every step that moved it, or only once finished."""

    CUMULATIVE = 0  # every step: everything so far (streaming)
    FINAL_ONLY = 2  # once, when finished (offline generation: no per-step output objects)


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping parameters of one request, with vLLM's names, defaults and valid ranges.

    Processing order per generated token (as in vLLM): min_tokens masks the stop tokens, then
    repetition -> frequency -> presence penalties, then temperature, min_p, top_k, top_p, then a sample.

    n: independent samples of the prompt (sample i of a seeded request behaves as seed + i).
    temperature: 0 (or below 1e-5) samples greedily; top_p, top_k and min_p are then switched off.
    top_p: keep the smallest set of tokens whose probability adds up to top_p; 1 = off.
    top_k: keep the k most likely tokens; -1 or 0 = off (0 is stored as -1).
    min_p: drop tokens whose probability is below min_p times the most likely one's; 0 = off.
    repetition_penalty: > 1 discourages every token seen in the prompt or output (logit / p if positive,
        logit * p if not); 1 = off.
    presence_penalty, frequency_penalty: subtract p once per token present in the output, or p times its
        count; 0 = off.
    seed: makes the request's samples reproducible whatever else runs in the same batch.
    stop: strings that end generation; the output is cut before them unless include_stop_str_in_output.
    stop_token_ids: tokens that end generation besides EOS.
    ignore_eos: keep generating past EOS (until max_tokens).
    max_tokens: most tokens to generate; None = until the model's context is full.
    min_tokens: EOS and stop_token_ids cannot be sampled before this many tokens.
    logprobs: return the log-probabilities of this many top tokens per generated token (plus the sampled
        one's); None = none. Log-probabilities are those of the model's raw logits.
    prompt_logprobs: the same for each prompt token.
    skip_special_tokens: leave special tokens out of the output text.
    include_stop_str_in_output: keep the stop string at the end of the output text.
    output_kind: RequestOutputKind.CUMULATIVE reports the request after every step, FINAL_ONLY only when it ends.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self._validate()
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.is_greedy:
            # Filtering cannot change an argmax; switching it off keeps greedy rows on the fast path.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {allowed}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "an int >= 1")
        if not isinstance(self.temperature, int | float) or not self.temperature >= 0:
            raise bad("temperature", "a float >= 0 (0 = greedy)")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a float in (0, 1] (1 = off)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an int >= 1, or -1 / 0 for off")
        if not isinstance(self.min_p, int | float) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a float in [0, 1] (0 = off)")
        if not isinstance(self.repetition_penalty, int | float) or not 0 < self.repetition_penalty < float("inf"):
            raise bad("repetition_penalty", "a finite float > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not -2 <= value <= 2:
                raise bad(name, "a float in [-2, 2] (0 = off)")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "an int or None")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (
            not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s for s in stops)
        ):
            raise bad("stop", "a non-empty string, a list of non-empty strings, or None")
        if self.stop_token_ids is not None and not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids >= 0, or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an int >= 1, or None for 'until the context is full'")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "a RequestOutputKind (CUMULATIVE or FINAL_ONLY)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise bad(name, "an int >= 0 (top tokens to return), or None")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def stop_token_set(self, eos_token_ids: int | Iterable[int] | None) -> set[int]:
        """Token ids that end generation: stop_token_ids, plus the EOS id(s) unless ignore_eos."""
        ids = set(self.stop_token_ids or [])
        if eos_token_ids is not None and not self.ignore_eos:
            ids.update([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids)
        return ids
