"""The step delta protocol: a worker's SequenceMirror, fed pickled StepMessages, rebuilds exactly the SchedulerOutput
the scheduler produced, step after step, through chunked prefill, forks with copy-on-write, prefix-cache hits,
preemptions, stops and aborts; and it forgets every sequence once it is gone."""

import pickle
import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from tritonllm.runtime.scheduler import Scheduler, SchedulerConfig
from tritonllm.runtime.step_messages import SequenceMirror, StepEncoder

VOCAB = 50


@dataclass
class Params:
    """Stands in for SamplingParams: the scheduler reads n, max_tokens and prompt_logprobs."""

    max_tokens: int
    n: int = 1
    prompt_logprobs: int | None = None


def assert_same_step(real, rebuilt, wanted: set[int], msg) -> None:
    assert rebuilt.block_copies == real.block_copies
    assert rebuilt.block_size == real.block_size
    assert rebuilt.num_batched_tokens == real.num_batched_tokens
    assert msg.prompt_logit_seq_ids == wanted
    assert len(rebuilt.scheduled) == len(real.scheduled)
    for a, b in zip(real.scheduled, rebuilt.scheduled, strict=True):
        assert (b.seq.seq_id, b.num_computed_tokens, b.num_new_tokens, b.sampled) == (
            a.seq.seq_id,
            a.num_computed_tokens,
            a.num_new_tokens,
            a.sampled,
        )
        assert b.seq.token_ids == a.seq.token_ids
        assert b.seq.num_prompt_tokens == a.seq.num_prompt_tokens
        assert b.seq.sample_index == a.seq.sample_index
        assert b.seq.sampling_params == a.seq.sampling_params
        assert b.block_table == a.block_table, f"seq {a.seq.seq_id}: block table differs"


@settings(max_examples=60)  # pure Python, milliseconds each
@given(
    seed=st.integers(0, 2**32 - 1),
    num_requests=st.integers(1, 7),
    num_blocks=st.sampled_from([5, 9, 40]),  # 5 and 9 force preemptions
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.sampled_from([3, 7, 64]),  # small budgets chunk the prefills
    prefix_caching=st.booleans(),
)
def test_mirror_rebuilds_every_step(seed, num_requests, num_blocks, block_size, budget, prefix_caching):
    rng = random.Random(seed)
    max_model_len = 24
    sched = Scheduler(
        SchedulerConfig(
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=6,
            max_num_batched_tokens=budget,
            enable_prefix_caching=prefix_caching,
        )
    )
    shared = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]  # common prefix: cache hits and forks
    for i in range(num_requests):
        prompt = shared[: rng.randint(0, len(shared))] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        params = Params(
            max_tokens=rng.randint(1, 8), n=rng.choice([1, 1, 2, 3]), prompt_logprobs=rng.choice([None, None, 2])
        )
        try:
            sched.add_request(str(i), prompt, params)
        except ValueError:  # more blocks than the pool holds: the engine refuses it the same way
            continue
    encoder, mirror = StepEncoder(), SequenceMirror()
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        if out.is_empty:
            encoder.discard(out.finished_seq_ids + out.preempted_seq_ids)
            sched.update_from_output(out, [])
            continue
        wanted = {e.seq.seq_id for e in out.scheduled if e.seq.sampling_params.prompt_logprobs is not None}
        msg = pickle.loads(pickle.dumps(encoder.encode(out, wanted)))
        assert_same_step(out, mirror.apply(msg), wanted, msg)
        sched.update_from_output(out, [rng.randrange(VOCAB) for _ in out.sampled])
        for e in out.sampled:  # content stops and aborts, as the engine makes them between steps
            if not e.seq.is_finished and rng.random() < 0.1:
                sched.finish_sequence(e.seq)
        if rng.random() < 0.05:
            sched.abort_request(rng.choice(list(sched._groups) or ["none"]))
    assert not sched.has_unfinished_requests()
    # The last finished ids reach the workers with the next schedule, which runs nothing.
    out = sched.schedule()
    encoder.discard(out.finished_seq_ids + out.preempted_seq_ids)
    mirror.apply(encoder.encode(out))
    assert len(encoder) == 0 and mirror.seqs == {}


def test_a_decode_step_sends_a_few_ints_per_sequence():
    sched = Scheduler(SchedulerConfig(max_model_len=4096, num_blocks=400, block_size=16))
    sched.add_request("long", list(range(3000)), Params(max_tokens=10))
    encoder, mirror = StepEncoder(), SequenceMirror()
    out = sched.schedule()
    prefill = pickle.dumps(encoder.encode(out))
    mirror.apply(pickle.loads(prefill))
    sched.update_from_output(out, [7])
    out = sched.schedule()
    decode = pickle.dumps(encoder.encode(out))
    msg = pickle.loads(decode)
    assert msg.new_seqs == []
    ((_, start, n, sampled, appended, keep, tail),) = msg.entries
    assert (start, n, sampled, appended) == (3000, 1, True, [7])
    assert keep == 3000 // 16 and len(tail) == 1
    assert mirror.apply(msg).scheduled[0].block_table == out.scheduled[0].block_table
    assert len(decode) < 200 < len(prefill)
