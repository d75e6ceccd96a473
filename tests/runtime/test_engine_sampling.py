"""Random sampling through the engine: parallel samples share the prompt's KV blocks yet stay independent, a
seeded request samples the same tokens whatever runs beside it, and the engine seed fixes unseeded runs."""

from hypothesis import Phase, given, settings

from tests.helpers import seeds
from tests.runtime.tiny_engine import (
    free_blocks_equal_total,
    fresh_thread,
    make_engine,
    random_prompt,
    run_alone,
    run_to_completion,
)
from tritonllm.runtime.sequence import SequenceStatus
from tritonllm.sampling_params import SamplingParams

ENGINE_SETTINGS = settings(max_examples=1, phases=[Phase.explicit, Phase.reuse, Phase.generate])


@ENGINE_SETTINGS
@given(seed=seeds())
@fresh_thread
def test_parallel_samples_share_prompt_blocks_and_equal_single_requests(seed):
    """n=3 with seed s gives sample i exactly what a single request with seed s + i gets; while the samples run,
    the prompt's full blocks are held once (ref count 3), and copy-on-write gives each sample its own last block."""
    prompt = random_prompt(seed, 6)  # blocks of 4: the first shared, the second (tokens 4, 5) split by copy-on-write
    params = SamplingParams(n=3, temperature=1.5, seed=seed, max_tokens=3, ignore_eos=True)
    engine = make_engine()
    bm = engine.scheduler.block_manager
    engine.add_request("n3", prompt, params)
    group = engine.scheduler._groups["n3"]

    shared_checked = False
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        seqs = group.seqs
        if all(s.status is SequenceStatus.RUNNING for s in seqs) and seqs[0].num_computed_tokens >= len(prompt):
            tables = [s.block_table for s in seqs]
            owned = set().union(*tables)
            assert bm.num_used_blocks == len(owned), "a shared block was counted more than once"
            shared = set(tables[0]).intersection(*tables[1:])
            assert tables[0][0] in shared, "the prompt's full block must be shared"
            assert all(bm.ref_counts[b] == 3 for b in shared)
            assert len({t[-1] for t in tables}) == 3, "each sample writes its own copy of the last block"
            shared_checked = True
    assert shared_checked
    assert final is not None and final.finished and len(final.outputs) == 3
    samples = [c.token_ids for c in final.outputs]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert len({tuple(s) for s in samples}) > 1, "samples of one request must be independent draws"

    # The same seeds as single requests, in one batch: sample i == request with seed + i.
    singles = make_engine()
    for i in range(3):
        singles.add_request(
            str(i), prompt, SamplingParams(temperature=1.5, seed=seed + i, max_tokens=3, ignore_eos=True)
        )
    alone = run_to_completion(singles)
    assert samples == [alone[str(i)].outputs[0].token_ids for i in range(3)]

    # A later n=2 request on the same prompt starts from the cached prefix blocks, then forks: same samples again.
    hits = engine.get_stats().prefix_cache_hits
    engine.add_request("n2", prompt, SamplingParams(n=2, temperature=1.5, seed=seed, max_tokens=2, ignore_eos=True))
    again = run_to_completion(engine)["n2"]
    assert engine.get_stats().prefix_cache_hits > hits
    assert [c.token_ids for c in again.outputs] == [s[:2] for s in samples[:2]]
    assert free_blocks_equal_total(engine)


# Every filter and penalty on, so each stage's batch handling is exercised.
FILTERED = dict(
    temperature=0.9,
    top_k=40,
    top_p=0.9,
    min_p=0.02,
    repetition_penalty=1.2,
    presence_penalty=0.3,
    frequency_penalty=0.2,
    max_tokens=4,
)


@ENGINE_SETTINGS
@given(seed=seeds())
@fresh_thread
def test_seeded_request_is_independent_of_the_batch(seed):
    prompt = random_prompt(seed, 5)
    target = SamplingParams(seed=seed, **FILTERED)
    alone = run_alone(prompt, target)

    # Neighbours: a greedy one, an unseeded one, one with other filters; the target joins a step later, in a
    # chunked batch, so it sits at another row with other neighbours each step.
    engine = make_engine(max_num_batched_tokens=6)
    engine.add_request("greedy", random_prompt(seed + 1, 7), SamplingParams(temperature=0, max_tokens=4))
    engine.add_request("unseeded", random_prompt(seed + 2, 3), SamplingParams(temperature=1.0, max_tokens=2))
    engine.step()
    engine.add_request("target", prompt, target)
    engine.add_request("other", random_prompt(seed + 3, 4), SamplingParams(seed=seed, top_k=5, max_tokens=4))
    outs = run_to_completion(engine)
    assert outs["target"].outputs[0].token_ids == alone.token_ids
    assert outs["target"].outputs[0].text == alone.text


@ENGINE_SETTINGS
@given(seed=seeds())
@fresh_thread
def test_engine_seed_makes_unseeded_runs_reproducible(seed):
    prompts = [random_prompt(seed, 3), random_prompt(seed + 1, 5)]

    def run(engine_seed: int) -> list[list[int]]:
        engine = make_engine(seed=engine_seed)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=1.5, max_tokens=3, ignore_eos=True))
        outs = run_to_completion(engine)
        return [outs[str(i)].outputs[0].token_ids for i in range(len(prompts))]

    first = run(seed)
    assert run(seed) == first
    assert run(seed + 1) != first
