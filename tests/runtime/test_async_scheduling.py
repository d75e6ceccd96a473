"""Asynchronous scheduling changes no answer: with continuations (the next decode step launched before the
current one's tokens reach the host) every request gets the tokens, text, logprobs and finish reasons it gets
with synchronous steps, including requests that stop on a token while a continuation runs, parallel samples,
seeded sampling, penalties (which run without continuations) and aborts in between."""

from hypothesis import Phase, given, settings

from tests.helpers import seeds
from tests.runtime.tiny_engine import (
    free_blocks_equal_total,
    fresh_thread,
    greedy,
    make_engine,
    random_prompt,
    run_to_completion,
)
from tritonllm.sampling_params import SamplingParams

ENGINE_SETTINGS = settings(max_examples=1, phases=[Phase.explicit, Phase.reuse, Phase.generate])


def count_continuations(engine) -> list[int]:
    """Counts the continuations the engine's scheduler hands out (one list entry: the count)."""
    scheduler, count = engine.scheduler, [0]
    schedule_continuation = scheduler.schedule_continuation

    def counting(previous):
        following = schedule_continuation(previous)
        count[0] += following is not None
        return following

    scheduler.schedule_continuation = counting
    return count


def workload(seed: int, stop_token: int) -> list[tuple[list[int], SamplingParams]]:
    return [
        (random_prompt(seed, 5), greedy(9, ignore_eos=True)),
        (random_prompt(seed + 1, 7), greedy(12, stop_token_ids=[stop_token])),
        (random_prompt(seed + 2, 3), SamplingParams(temperature=0.9, top_p=0.8, seed=seed, max_tokens=10, logprobs=2)),
        (random_prompt(seed + 3, 6), SamplingParams(temperature=1.0, n=2, max_tokens=7, top_k=20)),
        (random_prompt(seed + 4, 4), greedy(6, min_tokens=4, ignore_eos=True)),
    ]


def run(requests, async_scheduling: bool, **engine_kwargs):
    engine = make_engine(async_scheduling=async_scheduling, **engine_kwargs)
    continuations = count_continuations(engine)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    outs = run_to_completion(engine)
    assert free_blocks_equal_total(engine)
    return outs, continuations[0]


def completions(outs) -> dict:
    return {
        rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs]
        for rid, out in outs.items()
    }


@ENGINE_SETTINGS
@given(seed=seeds())
@fresh_thread
def test_outputs_equal_synchronous_scheduling(seed):
    # Stop request 1 on its 4th greedy token, so it ends while a continuation computes its 5th.
    alone = make_engine(async_scheduling=False)
    alone.add_request("probe", random_prompt(seed + 1, 7), greedy(12, ignore_eos=True))
    probe = run_to_completion(alone)["probe"].outputs[0].token_ids
    stop_token = probe[3]
    requests = workload(seed, stop_token)

    sync, none = run(requests, async_scheduling=False)
    outs, continuations = run(requests, async_scheduling=True)
    assert none == 0 and continuations > 5
    assert completions(outs) == completions(sync)
    stopped = outs["1"].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == probe[: probe.index(stop_token) + 1]


@ENGINE_SETTINGS
@given(seed=seeds())
@fresh_thread
def test_penalties_run_synchronously_with_the_same_answer(seed):
    params = SamplingParams(temperature=0.8, seed=seed, max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5)
    requests = [(random_prompt(seed, 4), params), (random_prompt(seed + 1, 6), greedy(8, ignore_eos=True))]
    sync, _ = run(requests, async_scheduling=False)
    outs, continuations = run(requests, async_scheduling=True)
    assert completions(outs) == completions(sync)
    # While the penalized request runs no step is continued; the greedy one goes on alone afterwards, if at all.
    assert continuations <= 1


@ENGINE_SETTINGS
@given(seed=seeds())
@fresh_thread
def test_abort_and_arrival_while_a_continuation_runs(seed):
    keep, dropped, late = random_prompt(seed, 5), random_prompt(seed + 1, 5), random_prompt(seed + 2, 3)
    reference = make_engine(async_scheduling=False)
    reference.add_request("keep", keep, greedy(10, ignore_eos=True))
    reference.add_request("late", late, greedy(4, ignore_eos=True))
    expected = completions(run_to_completion(reference))

    engine = make_engine()
    engine.add_request("keep", keep, greedy(10, ignore_eos=True))
    engine.add_request("dropped", dropped, greedy(10, ignore_eos=True))
    engine.step()  # prefill both; a continuation is launched behind it
    assert engine._ahead is not None
    assert engine.abort_request("dropped")
    engine.add_request("late", late, greedy(4, ignore_eos=True))  # waits: only a regular step admits
    outs = run_to_completion(engine)
    assert "dropped" not in outs
    assert completions(outs) == expected
    assert free_blocks_equal_total(engine) and engine._ahead is None
