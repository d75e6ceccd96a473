"""Asynchronous scheduling changes no answer: with continuations (the next step launched before the current one's
tokens reach the host) every request gets the tokens, text, logprobs and finish reasons it gets with synchronous
steps, including requests that stop on a token while a continuation runs, parallel samples, seeded sampling,
penalties (which count the token still on the device), aborts in between, and requests queued, admitted and
chunk-prefilled inside continuations (prompt logprobs included)."""

import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from tests.helpers import seeds
from tests.runtime.tiny_engine import (
    free_blocks_equal_total,
    fresh_thread,
    greedy,
    make_engine,
    random_prompt,
    run_to_completion,
)
from tritonllm.runtime.scheduler_output import ScheduledSequence, SchedulerOutput
from tritonllm.runtime.sequence import Sequence
from tritonllm.runtime.worker import continuation_input_ids
from tritonllm.sampling_params import SamplingParams

ENGINE_SETTINGS = settings(max_examples=1, phases=[Phase.explicit, Phase.reuse, Phase.generate])


def count_continuations(engine) -> list[int]:
    """Counts the continuations the engine's scheduler hands out, and their entries that read no pending token
    (prefill chunks, admissions): [continuations, such entries]."""
    scheduler, count = engine.scheduler, [0, 0]
    schedule_continuation = scheduler.schedule_continuation

    def counting(previous):
        following = schedule_continuation(previous)
        if following is not None:
            count[0] += 1
            count[1] += sum(1 for row in following.pending_token_rows if row < 0)
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
    """Outputs by request id, and [continuations, their entries that read no pending token]."""
    engine = make_engine(async_scheduling=async_scheduling, **engine_kwargs)
    continuations = count_continuations(engine)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    outs = run_to_completion(engine)
    assert free_blocks_equal_total(engine)
    return outs, continuations


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
    assert none[0] == 0 and continuations[0] > 5
    assert completions(outs) == completions(sync)
    stopped = outs["1"].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == probe[: probe.index(stop_token) + 1]


@ENGINE_SETTINGS
@given(seed=seeds())
@fresh_thread
def test_penalties_count_the_token_still_on_the_device(seed):
    # Negative penalties favour the tokens already out, the newest among them still on the device in a continuation:
    # left uncounted, it loses its boost and greedy outputs change.
    repeating = SamplingParams(temperature=0.0, max_tokens=6, frequency_penalty=-2.0, presence_penalty=-2.0)
    requests = [(random_prompt(seed + i, 5), repeating) for i in range(6)]
    for i in range(2):
        params = SamplingParams(
            temperature=1.0, seed=seed + i, max_tokens=8, repetition_penalty=1.3, presence_penalty=2.0
        )
        requests.append((random_prompt(seed + 10 + i, 4), params))
    sync, _ = run(requests, async_scheduling=False)
    outs, continuations = run(requests, async_scheduling=True)
    assert continuations[0] > 3
    assert completions(outs) == completions(sync)


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
    engine.add_request("late", late, greedy(4, ignore_eos=True))  # admitted by the next continuation
    outs = run_to_completion(engine)
    assert "dropped" not in outs
    assert completions(outs) == expected
    assert free_blocks_equal_total(engine) and engine._ahead is None


@ENGINE_SETTINGS
@given(seed=seeds())
@fresh_thread
def test_queued_requests_are_admitted_and_prefilled_inside_continuations(seed):
    # Three sequences at a time and 8 tokens a step: most requests wait, and prompts longer than what is left of a
    # step's budget are prefilled in chunks, both while continuations run.
    requests = [(random_prompt(seed + i, 3 + 2 * i), greedy(5 + i % 3, ignore_eos=True)) for i in range(6)]
    requests.append((random_prompt(seed + 9, 7), SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)))
    limits = dict(max_num_seqs=3, max_num_batched_tokens=8)
    sync, _ = run(requests, async_scheduling=False, **limits)
    outs, continuations = run(requests, async_scheduling=True, **limits)
    assert continuations[0] > 5 and continuations[1] > 3
    assert completions(outs) == completions(sync)
    assert outs["6"].prompt_logprobs == sync["6"].prompt_logprobs and len(outs["6"].prompt_logprobs) == 7


@given(
    entries=st.lists(st.tuples(st.integers(1, 5), st.booleans()), min_size=1, max_size=12),
    extra_samples=st.integers(0, 3),
    data=st.data(),
)
def test_pending_tokens_land_on_their_entries_rows(entries, extra_samples, data):
    # Entries that decode a pending token take one row each, anywhere among prefill chunks (a recompute after a
    # preemption sorts before younger decodes); their sample rows come in any order.
    entries = [(1 if pending else n, pending) for n, pending in entries]
    num_pending = sum(pending for _, pending in entries)
    rows = iter(data.draw(st.permutations(range(num_pending + extra_samples)))[:num_pending])
    scheduled, pending_rows = [], []
    for i, (n, pending) in enumerate(entries):
        seq = Sequence(i, str(i), [7] * 4, 4, None, i)
        scheduled.append(ScheduledSequence(seq, 4 if pending else 0, n, pending))
        pending_rows.append(next(rows) if pending else -1)
    out = SchedulerOutput(scheduled, sum(n for n, _ in entries), [], 4, [], [], pending_token_rows=pending_rows)
    vocab = 50
    samples = torch.randint(0, vocab, (num_pending + extra_samples,))
    input_ids = torch.randint(0, vocab, (out.num_batched_tokens,))

    expected, flat = input_ids.clone(), 0
    for (n, _), row in zip(entries, pending_rows, strict=True):
        if row >= 0:
            expected[flat] = samples[row]
        flat += n
    patch = continuation_input_ids(out, samples, vocab)
    if num_pending == 0:
        assert patch is None
        return
    patch.write_into(input_ids)
    assert torch.equal(input_ids, expected)


def test_pending_token_ids_out_of_the_vocabulary_are_clamped():
    seq = Sequence(0, "0", [7, 8], 2, None, 0)
    out = SchedulerOutput([ScheduledSequence(seq, 2, 1, True)], 1, [], 4, [], [], pending_token_rows=[0])
    patch = continuation_input_ids(out, torch.tensor([10**6]), vocab_size=50)
    assert patch.values.tolist() == [49] and patch.rows == [0]
