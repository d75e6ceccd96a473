"""Sample and prompt log-probabilities through the engine, checked against transformers' logits on the same
checkpoint; prompt logprobs stay complete with prefix caching on and across a preemption."""

import math

import torch
from hypothesis import Phase, given, settings

from tests.helpers import seeds
from tests.runtime.tiny_engine import (
    free_blocks_equal_total,
    fresh_thread,
    hf_logprobs,
    make_engine,
    random_prompt,
    run_to_completion,
)
from tritonllm.runtime.sequence import SequenceStatus
from tritonllm.sampling_params import SamplingParams

ENGINE_SETTINGS = settings(max_examples=1, phases=[Phase.explicit, Phase.reuse, Phase.generate])
TOL = 1e-4  # fp32 on both sides; only summation order differs


def rank_bounds(expected: torch.Tensor, token: int) -> tuple[int, int]:
    """The rank (1 = most likely) of `token` in the reference row, as an interval that allows fp32 noise."""
    value = float(expected[token])
    return int((expected > value + TOL).sum()) + 1, int((expected >= value - TOL).sum())


def check_position(entry: dict, token: int, expected: torch.Tensor, k: int, decode) -> None:
    """One position's logprobs dict against the reference log_softmax row `expected` [vocab]: the chosen token
    plus the top k, with their logprobs, ranks and text."""
    assert token in entry and k <= len(entry) <= k + 1
    for t, lp in entry.items():
        assert math.isclose(lp.logprob, float(expected[t]), abs_tol=TOL), (t, lp.logprob, float(expected[t]))
        low, high = rank_bounds(expected, t)
        assert low <= lp.rank <= high
        assert lp.decoded_token == decode(t)
    assert {t for t, lp in entry.items() if lp.rank <= k} == set(expected.topk(k).indices.tolist())


@ENGINE_SETTINGS
@given(seed=seeds())
@fresh_thread
def test_sample_and_prompt_logprobs_match_transformers(seed):
    prompt = random_prompt(seed, 7)
    engine = make_engine()
    decode = engine._decode_token
    sampled = engine.add_request(
        None, prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=4, logprobs=3, prompt_logprobs=2)
    )
    greedy = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=2, logprobs=0))
    outs = run_to_completion(engine)

    out = outs[sampled]
    completion = out.outputs[0]
    tokens = completion.token_ids
    assert len(tokens) == 4 and len(completion.logprobs) == 4
    expected = hf_logprobs(prompt + tokens)
    for i, (token, entry) in enumerate(zip(tokens, completion.logprobs, strict=True)):
        check_position(entry, token, expected[len(prompt) - 1 + i], 3, decode)
    assert math.isclose(
        completion.cumulative_logprob,
        sum(e[t].logprob for t, e in zip(tokens, completion.logprobs, strict=True)),
        abs_tol=TOL,
    )

    # Prompt logprobs: nothing predicts the first token; position i holds the actual prompt token i.
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        check_position(out.prompt_logprobs[i], prompt[i], expected[i - 1], 2, decode)

    g = outs[greedy].outputs[0]
    assert len(g.logprobs) == 2 and all(len(e) == 1 for e in g.logprobs)  # logprobs=0: the sampled token alone
    expected = hf_logprobs(prompt + g.token_ids)
    for i, (token, entry) in enumerate(zip(g.token_ids, g.logprobs, strict=True)):
        assert entry[token].rank == 1 and token == int(expected[len(prompt) - 1 + i].argmax())
        assert math.isclose(entry[token].logprob, float(expected[len(prompt) - 1 + i, token]), abs_tol=TOL)
    assert outs[greedy].prompt_logprobs is None


def check_prompt_logprobs(prompt_logprobs, prompt: list[int]) -> None:
    expected = hf_logprobs(prompt)
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry = prompt_logprobs[i]
        assert prompt[i] in entry and len(entry) <= 2
        assert math.isclose(entry[prompt[i]].logprob, float(expected[i - 1, prompt[i]]), abs_tol=TOL)


@ENGINE_SETTINGS
@given(seed=seeds())
@fresh_thread
def test_prompt_logprobs_skip_the_prefix_cache(seed):
    """A request asking for prompt logprobs computes its whole prompt even when the prefix cache holds it; a
    request beside it without them still takes the hit."""
    prompt = random_prompt(seed, 11)
    engine = make_engine(enable_prefix_caching=True)
    engine.add_request("warm", prompt, SamplingParams(temperature=0, max_tokens=1))
    run_to_completion(engine)
    assert engine.get_stats().prefix_cache_hits == 0

    engine.add_request("logprobs", prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    engine.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=1))
    outs = run_to_completion(engine)
    check_prompt_logprobs(outs["logprobs"].prompt_logprobs, prompt)
    # Only "plain" hit: the full blocks before the last prompt token.
    assert engine.get_stats().prefix_cache_hits == (len(prompt) - 1) // 4 * 4
    assert outs["plain"].outputs[0].token_ids == outs["logprobs"].outputs[0].token_ids


@ENGINE_SETTINGS
@given(seed=seeds())
@fresh_thread
def test_prompt_logprobs_survive_preemption(seed):
    """6 blocks of 4 tokens for three requests: the newest is preempted halfway through its prompt, then again
    after it (its logprobs all recorded). Prompt logprobs come out complete and right, each position once.
    Synchronous scheduling: the step-by-step timeline above is what the test sets up."""
    engine = make_engine(num_gpu_blocks=6, max_num_batched_tokens=6, async_scheduling=False)
    prompts = {
        "older": random_prompt(seed, 7),
        "first": random_prompt(seed + 1, 7),
        "newest": random_prompt(seed + 2, 9),
    }

    def add(name: str, **kwargs) -> None:
        engine.add_request(name, prompts[name], SamplingParams(temperature=0, ignore_eos=True, **kwargs))

    add("older", max_tokens=8)
    engine.step()
    add("first", max_tokens=3, prompt_logprobs=1)
    engine.step()
    engine.step()
    add("newest", max_tokens=3, prompt_logprobs=1)
    seq = engine.scheduler._groups["newest"].seqs[0]

    preempted_at = []  # the newest request's computed tokens when it was preempted
    finished = {}
    while engine.has_unfinished_requests():
        before, was_running = seq.num_computed_tokens, seq.status is SequenceStatus.RUNNING
        for out in engine.step():
            # Until complete, prompt logprobs are withheld rather than shown in part.
            assert out.prompt_logprobs is None or len(out.prompt_logprobs) == len(prompts[out.request_id])
            if out.finished:
                finished[out.request_id] = out
        if was_running and seq.status is SequenceStatus.PREEMPTED:
            preempted_at.append(before)
    assert len(preempted_at) == 2 and 0 < preempted_at[0] < 9 <= preempted_at[1], preempted_at
    for name in ("first", "newest"):
        check_prompt_logprobs(finished[name].prompt_logprobs, prompts[name])
    assert finished["older"].prompt_logprobs is None
    assert free_blocks_equal_total(engine)
