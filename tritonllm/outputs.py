"""What a request returns, with vLLM's names and shapes, so code written against vLLM reads these as-is."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: token id -> Logprob (the sampled token plus the requested top tokens).
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: None for the first (nothing predicts it), then token id -> Logprob, including the actual
# prompt token plus the requested top tokens.
PromptLogprobs = list[dict[int, Logprob] | None]


def logprobs_dict(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    rank: int,
    decode: Callable[[int], str] | None = None,
) -> dict[int, Logprob]:
    """One position's entry from a `LogprobsTensors` row (sliced to the request's top-k + 1 columns):
    column 0 is the chosen token with `rank`, then the top tokens with ranks 1, 2, ... (as vLLM builds it,
    a chosen token that is also in the top-k keeps its top-k entry)."""
    ranks = [rank, *range(1, len(token_ids))]
    return {
        int(t): Logprob(float(lp), r, decode(int(t)) if decode is not None else None)
        for t, lp, r in zip(token_ids, logprobs, ranks, strict=True)
    }


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n samples.

    finish_reason: None while running, then "stop" (EOS, a stop token or a stop string), "length"
    (max_tokens or the context length) or "abort". stop_reason: the stop string or stop token id that ended
    it, None for EOS or any other reason.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step: its prompt, its samples so far, and whether all of them finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
