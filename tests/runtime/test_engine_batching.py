"""Continuous batching changes no answer: chunked prefill, preemption by recompute and prefix caching all give
each request exactly the greedy tokens it gets when it runs alone."""

import pytest
from hypothesis import Phase, given, settings

from tests.helpers import seeds
from tests.runtime.tiny_engine import (
    free_blocks_equal_total,
    fresh_thread,
    greedy,
    make_engine,
    random_prompt,
    run_alone,
)

# One example per case: each runs tens of model steps through Triton's interpreter. No shrinking (the failing
# seed is printed and reproduces the case).
ENGINE_SETTINGS = settings(max_examples=1, phases=[Phase.explicit, Phase.reuse, Phase.generate])

# Prompt lengths around the block size (4) and the token budget (8); requests 0 and 1 share a 9-token prefix.
LENGTHS = [3, 7, 5, 11, 2, 9]
SHARED_PREFIX = 9


def workload(seed: int) -> list[tuple[list[int], object]]:
    prefix = random_prompt(seed, SHARED_PREFIX)
    prompts = [prefix + random_prompt(seed + 1, 2), prefix + random_prompt(seed + 2, 3)]
    prompts += [random_prompt(seed + 3 + i, n) for i, n in enumerate(LENGTHS)]
    # ignore_eos keeps the schedule (and so the preemptions) independent of the sampled values.
    params = [greedy(2 + i % 3, ignore_eos=True) for i in range(len(prompts))]
    return list(zip(prompts, params, strict=True))


@pytest.mark.parametrize("enable_prefix_caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
@ENGINE_SETTINGS
@given(seed=seeds())
@fresh_thread
def test_batched_greedy_outputs_equal_each_request_alone(enable_prefix_caching, seed):
    # An 8-token budget chunks every longer prompt; 5 blocks of 4 tokens cannot hold the 8 requests at once.
    engine = make_engine(num_gpu_blocks=5, max_num_batched_tokens=8, enable_prefix_caching=enable_prefix_caching)
    requests = workload(seed)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)

    finished = {}
    max_usage = 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        max_usage = max(max_usage, engine.get_stats().kv_cache_usage)

    stats = engine.get_stats()
    assert stats.num_preemptions > 0, "the KV pool was meant to be too small for all requests at once"
    assert stats.num_chunked_prefills > 0, "the token budget was meant to split prompts"
    assert max_usage > 0.5
    if enable_prefix_caching:
        # Request 1 is admitted once request 0's first chunk is in: it finds the two full blocks of the shared
        # prefix. (Preempted requests may find their own blocks too.)
        assert stats.prefix_cache_hits >= 8 and 0 < stats.prefix_cache_hit_rate < 1
    else:
        assert stats.prefix_cache_queries == stats.prefix_cache_hits == 0

    assert sorted(finished, key=int) == [str(i) for i in range(len(requests))]
    for i, (prompt, params) in enumerate(requests):
        alone = run_alone(prompt, params)
        got = finished[str(i)].outputs[0]
        assert got.token_ids == alone.token_ids, f"request {i}"
        assert (got.text, got.finish_reason) == (alone.text, alone.finish_reason), f"request {i}"
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert free_blocks_equal_total(engine)
