"""Perplexity of token sequences under a model, from the engine's prompt log-probabilities."""

import math
from collections.abc import Sequence

from tritonllm.entrypoints.llm import LLM
from tritonllm.sampling_params import SamplingParams


def perplexity(llm: LLM, sequences: Sequence[Sequence[int]]) -> float:
    """exp(mean negative log-likelihood) of every token after the first, over all sequences together."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": list(ids)} for ids in sequences], params, use_tqdm=False)
    total, count = 0.0, 0
    for out in outputs:
        for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
            total -= entry[token].logprob
            count += 1
    return math.exp(total / count)
