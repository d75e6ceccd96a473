"""Bad requests are refused at submission with a clear ValueError and change nothing; aborts at any point of a
request's life free all its blocks. Other requests in the same engine go on to the right output."""

import pytest

from tests.runtime.tiny_engine import (
    VOCAB,
    free_blocks_equal_total,
    fresh_thread,
    greedy,
    make_engine,
    random_prompt,
    run_alone,
    run_to_completion,
)
from tritonllm.sampling_params import SamplingParams

BAD_PROMPTS = [
    (list(range(10, 43)), "more than max_model_len=32"),
    ([5, VOCAB, 7], "outside the vocabulary"),
    ([5, -1], "outside the vocabulary"),
    ([], "empty prompt"),
    ({"prompt_token_ids": []}, "empty prompt"),
    ([5, "6"], "list of ints"),
    ([5, True], "list of ints"),
    ([5, 6.0], "list of ints"),
    (3.5, "a string, a list of token ids or a dict"),
    (None, "a string, a list of token ids or a dict"),
    ({"text": "hi"}, "'prompt' .* or 'prompt_token_ids'"),
]


@fresh_thread
def test_bad_requests_are_refused_and_change_nothing():
    prompt = random_prompt(7, 5)
    unseeded = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)

    def run(with_bad_requests: bool):
        engine = make_engine(max_model_len=32, num_gpu_blocks=7)
        engine.add_request("good", prompt, greedy(4))
        if with_bad_requests:
            for bad, message in BAD_PROMPTS:
                with pytest.raises(ValueError, match=message):
                    engine.add_request(None, bad, unseeded)
            with pytest.raises(ValueError, match="need 8 KV blocks"):  # fits max_model_len, not the pool
                engine.add_request(None, list(range(10, 40)), SamplingParams(max_tokens=2))
            with pytest.raises(ValueError, match="already in use"):
                engine.add_request("good", prompt, unseeded)
            with pytest.raises(ValueError, match="SamplingParams"):
                engine.add_request(None, prompt, {"temperature": 0})
            engine.step()  # a refusal mid-run changes nothing either
            with pytest.raises(ValueError, match="outside the vocabulary"):
                engine.add_request("late", [VOCAB + 3], unseeded)
        # Unseeded: its seed comes from the engine's generator, which refused requests must not have advanced.
        engine.add_request("sampled", prompt, unseeded)
        outs = run_to_completion(engine)
        assert sorted(outs) == ["good", "sampled"] and free_blocks_equal_total(engine)
        return outs

    outs = run(with_bad_requests=True)
    assert outs["good"].outputs[0].token_ids == run_alone(prompt, greedy(4)).token_ids
    assert outs["sampled"].outputs[0].token_ids == run(with_bad_requests=False)["sampled"].outputs[0].token_ids


@fresh_thread
def test_abort_at_any_point_frees_all_blocks():
    """Aborted before it runs, mid-prefill (chunked), with parallel samples before the fork and mid-decode after
    it; the request beside them still gets its greedy output, and the pool is whole at the end."""
    engine = make_engine(num_gpu_blocks=16, max_num_batched_tokens=6)
    bm = engine.scheduler.block_manager
    groups = engine.scheduler._groups

    finished = {}

    def step_until(condition) -> None:
        for _ in range(30):
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            if condition():
                return
        raise AssertionError("the engine never reached the state to abort in")

    def abort(request_id: str) -> None:
        seqs = groups[request_id].seqs
        held = {b for s in seqs for b in s.block_table}
        used = bm.num_used_blocks
        assert engine.abort_request(request_id)
        assert all(s.is_finished and not s.block_table for s in seqs)
        assert bm.num_used_blocks == used - len(held)
        assert not engine.abort_request(request_id)

    keep = random_prompt(1, 6)
    engine.add_request("keep", keep, greedy(5, ignore_eos=True))
    engine.add_request("queued", random_prompt(2, 5), greedy(4))
    abort("queued")  # never scheduled

    engine.add_request("prefill", random_prompt(3, 13), greedy(4))
    step_until(lambda: groups["prefill"].seqs[0].num_computed_tokens > 0)
    assert groups["prefill"].seqs[0].num_computed_tokens < 13
    abort("prefill")

    engine.add_request("unforked", random_prompt(4, 11), SamplingParams(n=2, temperature=1.0, max_tokens=4))
    step_until(lambda: groups["unforked"].seqs[0].num_computed_tokens > 0)
    assert groups["unforked"].pending_fork  # its second sample holds nothing yet
    abort("unforked")

    engine.add_request("forked", random_prompt(5, 6), SamplingParams(n=3, temperature=1.0, max_tokens=6))
    step_until(lambda: all(s.num_output_tokens >= 2 for s in groups["forked"].seqs))
    abort("forked")
    assert not engine.abort_request("unknown")

    finished.update(run_to_completion(engine))
    assert list(finished) == ["keep"]  # aborted requests report nothing
    assert finished["keep"].outputs[0].token_ids == run_alone(keep, greedy(5, ignore_eos=True)).token_ids
    assert free_blocks_equal_total(engine) and bm.num_held_blocks == 0
    assert engine.get_stats().kv_cache_usage == 0.0
