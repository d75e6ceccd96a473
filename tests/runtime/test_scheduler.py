import zlib
from array import array
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonllm.runtime.scheduler import Scheduler, SchedulerConfig
from tritonllm.runtime.scheduler_output import SchedulerOutput
from tritonllm.runtime.sequence import SequenceStatus

VOCAB = 40
EOS = 0


@dataclass
class Params:
    """Stands in for SamplingParams: the scheduler reads only n and max_tokens."""

    max_tokens: int | None = None
    n: int = 1


def next_token(context: list[tuple[int, int]], sample_index: int) -> int:
    """The fake model: a deterministic function of the (token, position) pairs it reads from the KV cache."""
    flat = [x for pair in context for x in pair] + [sample_index]
    return zlib.crc32(array("q", flat).tobytes()) % VOCAB


class FakeRunner:
    """Executes a SchedulerOutput on a fake KV cache that stores (token id, position) per slot."""

    def __init__(self, num_blocks: int, block_size: int):
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)

    def execute(self, out: SchedulerOutput, previous_tokens: list[int] | None = None) -> list[int]:
        """The sampled tokens; a continuation reads its input tokens from `previous_tokens` (the samples of the
        step it follows, not yet applied), as the GPU does."""
        bs = out.block_size
        blocks = {src: self.kv[src * bs : (src + 1) * bs] for src, _ in out.block_copies}
        for src, dst in out.block_copies:
            self.kv[dst * bs : (dst + 1) * bs] = blocks[src]

        def slot(entry, p):
            return entry.block_table[p // bs] * bs + p % bs

        for i, e in enumerate(out.scheduled):  # a layer writes every new token's KV, then attends
            if out.is_continuation and out.pending_token_rows[i] >= 0:
                assert e.num_new_tokens == 1 and e.num_computed_tokens == e.seq.num_tokens  # its token is pending
                self.kv[slot(e, e.num_computed_tokens)] = (previous_tokens[out.pending_token_rows[i]], e.seq_len - 1)
                continue
            for p, token in enumerate(e.new_token_ids, start=e.num_computed_tokens):
                self.kv[slot(e, p)] = (token, p)
        return [next_token([self.kv[slot(e, p)] for p in range(e.seq_len)], e.seq.sample_index) for e in out.sampled]


def expected_outputs(prompt: list[int], params: Params, max_model_len: int) -> list[list[int]]:
    """What each sample of a request generates when it runs alone."""
    samples = []
    for i in range(params.n):
        tokens = list(prompt)
        while True:
            tokens.append(next_token([(t, p) for p, t in enumerate(tokens)], i))
            out = len(tokens) - len(prompt)
            if tokens[-1] == EOS or out == params.max_tokens or len(tokens) >= max_model_len:
                break
        samples.append(tokens[len(prompt) :])
    return samples


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg, bm = sched.config, sched.block_manager
    assert out.num_batched_tokens == sum(e.num_new_tokens for e in out.scheduled) <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs
    # A continuation may seat a sequence in place of one that the step before ends by length (freed once applied).
    ending = {s.seq_id for s in sched.running if sched._reached_length(s, pending=1)} if out.is_continuation else ()
    assert sum(1 for s in sched.running if s.seq_id not in ending) <= cfg.max_num_seqs
    assert len({e.seq.seq_id for e in out.scheduled}) == len(out.scheduled)
    pending = out.pending_token_rows or [-1] * len(out.scheduled)
    for e, row in zip(out.scheduled, pending, strict=True):
        assert e.seq.status is SequenceStatus.RUNNING and e.num_new_tokens >= 1
        # A continuation's decode lacks the one token the step before is sampling.
        assert e.sampled == (e.seq_len == e.seq.num_tokens + (row >= 0))
        assert len(e.block_table) == bm.num_blocks_for(e.seq_len)
        if cfg.long_prefill_token_threshold:
            assert e.num_new_tokens <= cfg.long_prefill_token_threshold
    owners = Counter(b for s in sched.running for b in s.block_table)
    assert all(bm.ref_counts[b] == owners.get(b, 0) for b in range(bm.num_blocks))
    assert bm.get_num_free_blocks() + len(owners) == bm.num_blocks


def run_engine(cfg: SchedulerConfig, requests, aborts=(), max_steps=5000, asynchronous=False):
    """Continuous batching with requests arriving at their step; returns outputs per request and a log.
    asynchronous: as the engine with asynchronous scheduling, each step may be followed by a continuation
    scheduled and run before the step's tokens are applied."""
    sched, runner = Scheduler(cfg), FakeRunner(cfg.num_blocks, cfg.block_size)
    groups, log = {}, Counter()
    step = 0
    ahead = None  # a continuation and its tokens, run before the step it follows was applied
    while step <= max(r[3] for r in requests) or sched.has_unfinished_requests() or ahead:
        for rid, prompt, params, arrival in requests:
            if arrival == step:
                groups[rid] = sched.add_request(rid, prompt, params)
        for rid, at in aborts:
            if at == step:
                sched.abort_request(rid)
        if ahead is None:
            out = sched.schedule()
            check_step(sched, out)
            tokens = runner.execute(out)
        else:
            (out, tokens), ahead = ahead, None
        log["preempted"] += len(out.preempted_seq_ids)
        log["copies"] += len(out.block_copies)
        log["chunks"] += sum(1 for e in out.scheduled if not e.sampled)
        if asynchronous and (following := sched.schedule_continuation(out)) is not None:
            check_step(sched, following)
            ahead = (following, runner.execute(following, tokens))
            log["continuations"] += 1
            log["continued_prefills"] += sum(1 for row in following.pending_token_rows if row < 0)
        sched.update_from_output(out, tokens)
        for e in out.sampled:  # the engine's own stop check
            if not e.seq.is_finished and e.seq.token_ids[-1] == EOS:
                sched.finish_sequence(e.seq)
        step += 1
        assert step < max_steps, "no progress"
    bm = sched.block_manager
    assert bm.get_num_free_blocks() == cfg.num_blocks and not sched.running and not sched.waiting
    log["hits"] = bm.prefix_cache_hits
    return {rid: [s.output_token_ids for s in g.seqs] for rid, g in groups.items()}, groups, log


def step(sched: Scheduler, token: int = 1) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, [token] * len(out.sampled))
    return out


# ---- the engine loop: everyone gets exactly what they get alone -----------------------------------------

SHARED = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [3] * 9, []]


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    requests = []
    for i in range(draw(st.integers(2, 7))):
        prompt = draw(st.sampled_from(SHARED)) + draw(st.lists(st.integers(1, VOCAB - 1), max_size=12))
        params = Params(max_tokens=draw(st.sampled_from([1, 3, 9, None])), n=draw(st.sampled_from([1, 1, 2, 3])))
        requests.append((f"r{i}", prompt or [1], params, draw(st.integers(0, 4))))
    max_model_len = 40
    need = -(-(max_model_len - 1) // block_size)  # the most one sequence can hold; a tight pool preempts
    cfg = dict(
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=need + draw(st.sampled_from([0, 1, 4, 64])),
        max_num_seqs=draw(st.sampled_from([3, 4, 256])),
        max_num_batched_tokens=draw(st.sampled_from([1, 5, 16, 512])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 7])),
    )
    aborts = draw(st.lists(st.tuples(st.sampled_from([r[0] for r in requests]), st.integers(0, 30)), max_size=2))
    return cfg, requests, aborts


@settings(max_examples=40)
@given(workloads())
def test_continuous_batching_matches_running_alone(workload):
    cfg, requests, aborts = workload
    results = {}
    for caching, asynchronous in ((True, False), (False, False), (True, True)):
        outputs, groups, _ = run_engine(
            SchedulerConfig(**cfg, enable_prefix_caching=caching), requests, aborts, asynchronous=asynchronous
        )
        for rid, prompt, params, _ in requests:
            expected = expected_outputs(prompt, params, cfg["max_model_len"])
            for seq, want in zip(groups[rid].seqs, expected, strict=True):
                if seq.status is SequenceStatus.FINISHED_ABORTED:
                    assert want[: seq.num_output_tokens] == seq.output_token_ids  # a prefix of the real answer
                else:
                    assert seq.output_token_ids == want
                    # Length is checked first (in update_from_output), content by the engine after.
                    by_length = len(want) == params.max_tokens or seq.num_tokens >= cfg["max_model_len"]
                    assert seq.status is (
                        SequenceStatus.FINISHED_LENGTH if by_length else SequenceStatus.FINISHED_STOPPED
                    )
        aborted = {rid for rid, g in groups.items() if any(x.status is SequenceStatus.FINISHED_ABORTED for x in g.seqs)}
        results[caching, asynchronous] = {rid: out for rid, out in outputs.items() if rid not in aborted}
    # An abort may land before or after the end.
    finished = set.intersection(*(set(r) for r in results.values()))
    assert len({repr({r: out[r] for r in sorted(finished)}) for out in results.values()}) == 1


def test_engine_loop_exercises_chunking_preemption_prefix_cache_and_cow():
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    requests = [(f"r{i}", prompt + [20 + i] * i, Params(max_tokens=12, n=1 + i % 3), i % 3) for i in range(6)]
    for caching, asynchronous in ((True, False), (False, False), (True, True)):
        cfg = SchedulerConfig(
            max_model_len=64,
            num_blocks=13,  # the longest request alone: 14 prompt + 11 computed output tokens
            block_size=2,
            max_num_batched_tokens=8,
            enable_prefix_caching=caching,
        )
        outputs, _, log = run_engine(cfg, requests, asynchronous=asynchronous)
        for rid, p, params, _ in requests:
            assert outputs[rid] == expected_outputs(p, params, 64)
        assert log["preempted"] > 0 and log["chunks"] > 0 and log["copies"] > 0
        assert (log["hits"] > 0) == caching
        assert (log["continued_prefills"] > 0) == asynchronous


# ---- budget, chunked prefill, admission ---------------------------------------------------------------


def test_token_budget_and_max_num_seqs():
    cfg = SchedulerConfig(max_model_len=64, num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    sched = Scheduler(cfg)
    for i in range(5):
        sched.add_request(f"r{i}", [i + 1] * 10, Params(max_tokens=3))
    out = step(sched)
    assert [(e.seq.request_id, e.num_computed_tokens, e.num_new_tokens, e.sampled) for e in out.scheduled] == [
        ("r0", 0, 10, True),
        ("r1", 0, 6, False),
    ]
    out = step(sched)
    assert [(e.seq.request_id, e.num_computed_tokens, e.num_new_tokens, e.sampled) for e in out.scheduled] == [
        ("r0", 10, 1, True),
        ("r1", 6, 4, True),
        ("r2", 0, 10, True),  # r3 would make 4 running sequences
    ]
    assert out.num_batched_tokens == 15 and sched.get_stats().num_waiting == 2
    while sched.has_unfinished_requests():
        out = step(sched)
        assert out.num_batched_tokens <= 16 and len(sched.running) <= 3


def test_chunked_prefill():
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=8, block_size=16, max_num_batched_tokens=16))
    prompt = list(range(1, 51))
    group = sched.add_request("r", prompt, Params(max_tokens=2))
    entries = [step(sched, token=99).scheduled for _ in range(4)]
    assert [(e.num_computed_tokens, e.num_new_tokens, e.sampled) for (e,) in entries] == [
        (0, 16, False),
        (16, 16, False),
        (32, 16, False),
        (48, 2, True),
    ]
    assert [e.new_token_ids for (e,) in entries] == [prompt[0:16], prompt[16:32], prompt[32:48], prompt[48:50]]
    assert group.seqs[0].output_token_ids == [99]
    (e,) = step(sched).scheduled
    assert (e.num_computed_tokens, e.num_new_tokens, e.new_token_ids) == (50, 1, [99])
    assert group.is_finished and group.seqs[0].status is SequenceStatus.FINISHED_LENGTH


def test_long_prefill_threshold_shares_a_step():
    cfg = SchedulerConfig(max_model_len=64, num_blocks=16, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    sched = Scheduler(cfg)
    sched.add_request("a", [1] * 20)
    sched.add_request("b", [2] * 20)
    assert [e.num_new_tokens for e in step(sched).scheduled] == [8, 8]


def test_preemption_evicts_newest_and_resumes_by_recompute():
    cfg = SchedulerConfig(max_model_len=64, num_blocks=6, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(cfg)
    seqs = [sched.add_request(f"r{i}", [i + 1] * 3, Params(max_tokens=6)).seqs[0] for i in range(3)]
    step(sched, 7)  # 3 prompts of 3 tokens: 2 blocks each, the pool is full
    step(sched, 8)  # decodes at position 3 still fit
    out = step(sched, 9)  # position 4 needs a third block: the newest sequence goes
    victim = seqs[2]
    assert out.preempted_seq_ids == [victim.seq_id] and sched.get_stats().num_preemptions == 1
    assert [e.seq for e in out.scheduled] == seqs[:2]
    assert victim.status is SequenceStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert victim.block_table == [] and sched.waiting == [victim]
    assert victim.output_token_ids == [7, 8]  # kept: the recompute covers them
    while victim.status is not SequenceStatus.RUNNING:
        out = step(sched, 5)
    (resumed,) = [e for e in out.scheduled if e.seq is victim]
    assert (resumed.num_computed_tokens, resumed.new_token_ids, resumed.sampled) == (0, [3, 3, 3, 7, 8], True)


def test_preempted_sequence_reuses_its_cached_blocks():
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=8, block_size=2))
    seqs = [sched.add_request(f"r{i}", [i + 1] * 3, Params(max_tokens=4)).seqs[0] for i in range(3)]
    for _ in range(3):  # r2 fills blocks [3, 3] [3, 7] by its first decode, then is preempted
        out = step(sched, 7)
    assert out.preempted_seq_ids == [seqs[2].seq_id]
    while seqs[2].status is not SequenceStatus.RUNNING:
        out = step(sched, 7)
    (resumed,) = [e for e in out.scheduled if e.seq is seqs[2]]
    assert (resumed.num_computed_tokens, resumed.new_token_ids) == (4, [7])
    assert seqs[2].num_cached_tokens == 4


def test_requests_that_can_never_run_are_rejected_at_add_time():
    cfg = SchedulerConfig(max_model_len=32, num_blocks=4, block_size=4, max_num_seqs=4)
    sched = Scheduler(cfg)
    with pytest.raises(ValueError, match=r"33 tokens, more than max_model_len=32"):
        sched.add_request("long", [1] * 33)
    with pytest.raises(ValueError, match=r"need 5 KV blocks .* num_blocks=4"):
        sched.add_request("big", [1] * 10, Params(max_tokens=11))
    with pytest.raises(ValueError, match=r"need 8 KV blocks .* num_blocks=4"):
        sched.add_request("unbounded", [1] * 10, Params(max_tokens=None))
    with pytest.raises(ValueError, match=r"n=5 .* max_num_seqs=4"):
        sched.add_request("wide", [1], Params(max_tokens=1, n=5))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request("empty", [], Params(max_tokens=1))
    assert not sched.has_unfinished_requests()
    group = sched.add_request("fits", [1] * 10, Params(max_tokens=7))  # 16 tokens in KV: exactly 4 blocks
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request("fits", [1], Params(max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched)
    assert group.seqs[0].num_output_tokens == 7 and sched.get_stats().num_preemptions == 0


def test_full_length_prompt_gets_one_token():
    sched = Scheduler(SchedulerConfig(max_model_len=8, num_blocks=2, block_size=4))
    group = sched.add_request("r", [1] * 8)
    step(sched, 3)
    assert group.seqs[0].output_token_ids == [3] and group.seqs[0].status is SequenceStatus.FINISHED_LENGTH


# ---- aborts, fork, errors ------------------------------------------------------------------------------


def test_abort_frees_blocks_at_once():
    cfg = SchedulerConfig(max_model_len=64, num_blocks=8, block_size=4, max_num_batched_tokens=8)
    sched = Scheduler(cfg)
    running = sched.add_request("run", [1] * 12, Params(max_tokens=4))
    waiting = sched.add_request("wait", [2] * 12, Params(max_tokens=4))
    step(sched)
    assert sched.block_manager.get_num_free_blocks() == 6
    assert sched.abort_request("run") and sched.abort_request("wait")
    assert sched.block_manager.get_num_free_blocks() == 8
    assert running.seqs[0].status is waiting.seqs[0].status is SequenceStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests() and not sched.abort_request("run")
    out = sched.schedule()
    assert out.is_empty and sorted(out.finished_seq_ids) == [running.seqs[0].seq_id, waiting.seqs[0].seq_id]
    sched.update_from_output(out, [])


def test_abort_during_a_step_is_skipped_by_the_update():
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=8, block_size=4))
    group = sched.add_request("r", [1] * 5, Params(max_tokens=4, n=2))
    out = sched.schedule()
    assert sched.abort_request("r")
    assert sched.update_from_output(out, []) == []
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in group.seqs)  # the unforked sample too
    assert group.seqs[0].num_computed_tokens == 0 and sched.block_manager.get_num_free_blocks() == 8


def test_parallel_samples_fork_and_copy_on_write():
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=16, block_size=4))
    group = sched.add_request("r", [1, 2, 3, 4, 5, 6], Params(max_tokens=2, n=3))
    parent, *children = group.seqs
    (e,) = step(sched).scheduled  # the prompt, one token short: nothing sampled yet
    assert (e.seq, e.num_new_tokens, e.sampled) == (parent, 5, False)
    assert all(c.status is SequenceStatus.RUNNING and c.block_table == parent.block_table for c in children)
    full, shared = parent.block_table
    assert sched.block_manager.ref_counts[full] == sched.block_manager.ref_counts[shared] == 3
    out = sched.schedule()
    assert [(x.seq, x.num_computed_tokens, x.num_new_tokens, x.sampled) for x in out.scheduled] == [
        (s, 5, 1, True) for s in group.seqs
    ]
    # The first two writers copy the shared partial block; the last one owns it by then.
    assert [src for src, _ in out.block_copies] == [shared, shared]
    assert [dst for _, dst in out.block_copies] == [parent.block_table[1], children[0].block_table[1]]
    assert children[1].block_table == [full, shared]
    assert all(s.block_table[0] == full for s in group.seqs)
    sched.update_from_output(out, [7, 8, 9])
    assert [s.output_token_ids for s in group.seqs] == [[7], [8], [9]]


def test_parallel_samples_fork_at_admission_on_a_prefix_hit():
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=16, block_size=4))
    sched.add_request("first", [1, 2, 3, 4, 5], Params(max_tokens=1))
    step(sched)
    group = sched.add_request("second", [1, 2, 3, 4, 5], Params(max_tokens=1, n=3))
    out = sched.schedule()  # 4 tokens cached = the fork point: fork, the parent computes the last token
    assert [(e.seq, e.num_computed_tokens, e.num_new_tokens, e.sampled) for e in out.scheduled] == [
        (group.seqs[0], 4, 1, True)
    ]
    assert out.block_copies == [] and sched.running == group.seqs
    assert all(s.num_computed_tokens == 4 and s.num_cached_tokens == 4 for s in group.seqs)
    sched.update_from_output(out, [1])
    out = step(sched)
    assert [e.seq for e in out.scheduled] == group.seqs[1:] and out.block_copies == []
    assert group.is_finished and sched.block_manager.get_num_free_blocks() == 16


def test_misuse_is_reported():
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=8))
    sched.add_request("r", [1, 2, 3])
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="before update_from_output"):
        sched.schedule()
    with pytest.raises(ValueError, match="one per SchedulerOutput.sampled"):
        sched.update_from_output(out, [])
    sched.update_from_output(out, [4])
    with pytest.raises(ValueError, match="oldest scheduled step"):
        sched.update_from_output(out, [4])
    with pytest.raises(ValueError, match=">= 1"):
        SchedulerConfig(max_model_len=64, num_blocks=0)


def test_stats():
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=10, block_size=4))
    sched.add_request("a", list(range(1, 10)), Params(max_tokens=1))
    step(sched)
    sched.add_request("b", list(range(1, 10)), Params(max_tokens=5))
    sched.add_request("c", [7] * 30, Params(max_tokens=5))
    step(sched)
    stats = sched.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (1, 1, 0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 18)
    assert stats.kv_cache_usage == pytest.approx(0.3)


# ---- asynchronous scheduling: continuations ------------------------------------------------------------


def test_continuations_decode_the_pending_tokens_until_the_length_limit():
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=8, block_size=4))
    (seq,) = sched.add_request("r", [11, 12, 13], Params(max_tokens=4)).seqs
    out = sched.schedule()
    tokens = iter([21, 22, 23, 24])
    steps = 0
    while (following := sched.schedule_continuation(out)) is not None:
        (entry,) = following.scheduled
        # The token `out` samples goes to position seq_len of `out`; its block exists before the update.
        assert following.pending_token_rows == [0] and entry.num_new_tokens == 1 and entry.sampled
        assert entry.num_computed_tokens == out.scheduled[0].seq_len == seq.num_tokens
        assert len(seq.block_table) == sched.block_manager.num_blocks_for(entry.seq_len)
        with pytest.raises(ValueError, match="oldest scheduled step"):
            sched.update_from_output(following, [0])
        sched.update_from_output(out, [next(tokens)])
        out, steps = following, steps + 1
    sched.update_from_output(out, [next(tokens)])
    # The prefill and three continuations; the fourth token ends the request, so nothing continues it.
    assert steps == 3 and seq.output_token_ids == [21, 22, 23, 24] and seq.status is SequenceStatus.FINISHED_LENGTH
    assert sched.block_manager.get_num_free_blocks() == 8 and not sched.has_unfinished_requests()


def test_continuation_leaves_out_sequences_that_end_by_length():
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=8, block_size=4))
    short = sched.add_request("short", [1, 2], Params(max_tokens=1)).seqs[0]
    long = sched.add_request("long", [3, 4], Params(max_tokens=5)).seqs[0]
    out = sched.schedule()
    following = sched.schedule_continuation(out)
    assert [e.seq for e in following.scheduled] == [long] and following.pending_token_rows == [1]
    sched.update_from_output(out, [5, 6])
    assert short.status is SequenceStatus.FINISHED_LENGTH and long.token_ids == [3, 4, 6]
    sched.update_from_output(following, [7])
    assert long.token_ids == [3, 4, 6, 7] and long.num_computed_tokens == 3


def test_a_sequence_stopped_while_its_continuation_ran_keeps_no_extra_token():
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=8, block_size=4))
    (seq,) = sched.add_request("r", [1, 2, 3], Params(max_tokens=10)).seqs
    out = sched.schedule()
    following = sched.schedule_continuation(out)
    sched.update_from_output(out, [EOS])
    sched.finish_sequence(seq)  # the engine's stop check: EOS
    assert sched.block_manager.get_num_free_blocks() == 8
    assert sched.schedule_continuation(following) is None  # nothing runs on
    sched.update_from_output(following, [9])
    assert seq.output_token_ids == [EOS] and seq.num_computed_tokens == 3 and seq.status.is_finished


def test_continuation_admits_waiting_sequences_and_goes_on_with_prefill_chunks():
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=16, block_size=4, max_num_batched_tokens=6))
    first = sched.add_request("first", [1, 2, 3], Params(max_tokens=5)).seqs[0]
    long = sched.add_request("long", list(range(10, 20)), Params(max_tokens=2)).seqs[0]
    out = sched.schedule()  # first's prompt (3) and a 3-token chunk of long's
    assert [(e.seq, e.num_new_tokens, e.sampled) for e in out.scheduled] == [(first, 3, True), (long, 3, False)]
    late = sched.add_request("late", [7, 8], Params(max_tokens=2)).seqs[0]
    following = sched.schedule_continuation(out)
    # first decodes the token `out` samples; long's next chunk and late's prompt are on the host.
    assert [(e.seq, e.num_computed_tokens, e.num_new_tokens, e.sampled) for e in following.scheduled] == [
        (first, 3, 1, True),
        (long, 3, 5, False),
    ]
    assert following.pending_token_rows == [0, -1] and following.num_batched_tokens == 6
    assert late.status is SequenceStatus.WAITING  # the budget is spent
    sched.update_from_output(out, [41])
    sched.update_from_output(following, [42])
    assert first.token_ids == [1, 2, 3, 41, 42] and long.num_computed_tokens == 8

    out = sched.schedule()
    assert [(e.seq, e.num_new_tokens) for e in out.scheduled] == [(first, 1), (long, 2), (late, 2)]
    fourth = sched.add_request("fourth", [9, 9, 9], Params(max_tokens=1)).seqs[0]
    following = sched.schedule_continuation(out)
    assert [(e.seq, e.num_new_tokens, e.sampled) for e in following.scheduled] == [
        (first, 1, True),
        (long, 1, True),
        (late, 1, True),
        (fourth, 3, True),
    ]
    assert following.pending_token_rows == [0, 1, 2, -1] and fourth.status is SequenceStatus.RUNNING


def test_continuation_declines_where_only_schedule_can_go_on():
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=2, block_size=4))
    sched.add_request("r", [1, 2, 3, 4], Params(max_tokens=4))
    sched.add_request("other", [5], Params(max_tokens=2))  # takes the second block
    out = sched.schedule()
    assert sched.block_manager.get_num_free_blocks() == 0
    assert sched.schedule_continuation(out) is None  # "r" goes on at position 4: a new block, none free
    assert [len(e.seq.block_table) for e in out.scheduled] == [1, 1]  # the decline changed nothing
    assert not sched.waiting

    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=8, block_size=4))
    sched.add_request("n2", [1, 2, 3, 4, 5], Params(max_tokens=3, n=2))
    out = sched.schedule()  # the parent computes the shared prompt part; its samples fork after it
    assert sched.schedule_continuation(out) is None

    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=8, block_size=4))
    sched.add_request("r", [1, 2, 3, 4], Params(max_tokens=4))
    out = sched.schedule()
    sched.add_request("n2", [5, 6, 7], Params(max_tokens=3, n=2))  # would fork: only schedule() admits it
    following = sched.schedule_continuation(out)
    assert [e.seq.request_id for e in following.scheduled] == ["r"] and len(sched.waiting) == 1

    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=8, block_size=4))
    sched.add_request("r", [1, 2, 3, 4], Params(max_tokens=4))
    out = sched.schedule()
    sched.add_request("late", [5, 6], Params(max_tokens=2))
    out.preempted_seq_ids = [99]  # as if this step had preempted: schedule() admits nothing after that either
    following = sched.schedule_continuation(out)
    assert [e.seq.request_id for e in following.scheduled] == ["r"] and len(sched.waiting) == 1

    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=8, block_size=4, max_num_seqs=1))
    sched.add_request("r", [1, 2, 3], Params(max_tokens=1))
    out = sched.schedule()
    sched.add_request("next", [4, 5], Params(max_tokens=1))
    following = sched.schedule_continuation(out)  # "r" ends by length with `out`'s token: its seat frees up
    assert [e.seq.request_id for e in following.scheduled] == ["next"] and following.pending_token_rows == [-1]


def test_continuation_misuse_is_reported():
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_blocks=8, block_size=4))
    sched.add_request("r", [1, 2, 3], Params(max_tokens=10))
    out = sched.schedule()
    following = sched.schedule_continuation(out)
    with pytest.raises(RuntimeError, match="only step in flight"):
        sched.schedule_continuation(following)  # `out` is still in flight too
    with pytest.raises(RuntimeError, match="before update_from_output"):
        sched.schedule()


def test_asynchronous_engine_loop_runs_continuations():
    requests = [(f"r{i}", [3 + i] * (4 + i), Params(max_tokens=12), 0) for i in range(3)]
    cfg = SchedulerConfig(max_model_len=40, num_blocks=64, block_size=4)
    outputs, _, log = run_engine(cfg, requests, asynchronous=True)
    # One prefill step, then continuations until the sequences end (by EOS or at 12 tokens).
    assert log["continuations"] >= max(len(o[0]) for o in outputs.values()) - 2
    for rid, prompt, params, _ in requests:
        assert outputs[rid] == expected_outputs(prompt, params, 40)
