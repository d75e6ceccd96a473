"""Continuous-batching scheduler: token budget, chunked prefill, prefix caching, preemption by recompute.

No prefill/decode phases. Each sequence has num_computed_tokens; a step gives every running sequence
(oldest first) the tokens it still lacks, capped by the step's token budget (so a long prompt is
prefilled in chunks, and a decode takes 1), then admits waiting sequences FCFS while the budget,
max_num_seqs and the KV blocks allow. A sequence is sampled in a step only if that step computes its
last token. When blocks run out the newest running sequence is preempted: its blocks are freed,
num_computed_tokens drops to 0 and it re-queues by age, keeping its generated tokens, so the recompute
covers them and it goes on exactly where it was.

Engine loop:
    out = scheduler.schedule()
    token_ids = runner.execute(out)                          # one per out.sampled entry
    ended = scheduler.update_from_output(out, token_ids)     # appends tokens; ends sequences by length
    for e in out.sampled: if e.seq is not finished and it hit EOS / a stop string:
        scheduler.finish_sequence(e.seq)                     # stop conditions on content: the engine's

Asynchronous scheduling: while `out` still runs, `schedule_continuation(out)` may hand out the next step, in
which every sequence `out` samples decodes the token `out` is sampling (the runner reads it on the device),
prefill chunks go on and waiting sequences are admitted, so the GPU never waits for the host. It declines (None)
where only `schedule()` can go on: too few free blocks (preemption), a shared block to copy, a fork. Outputs are
then applied in order, `out` first. A sequence that `out` ends on content (EOS) has run one token too many; its
result is dropped.
"""

import itertools
from bisect import insort
from collections.abc import Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from tritonllm.runtime.block_manager import NO_HIT, BlockManager, PrefixHit
from tritonllm.runtime.scheduler_output import ScheduledSequence, SchedulerOutput, SchedulerStats
from tritonllm.runtime.sequence import Sequence, SequenceGroup, SequenceStatus

_KEY = attrgetter("sort_key")


@dataclass(slots=True, kw_only=True)
class SchedulerConfig:
    max_model_len: int  # most tokens (prompt + output) a sequence may reach
    num_blocks: int  # KV blocks in the pool (the runner sizes it from its memory budget)
    block_size: int = 16
    max_num_seqs: int = 256  # running sequences at once (the n samples of a request count n)
    max_num_batched_tokens: int = 8192  # new tokens per step, all sequences together
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0  # > 0: one sequence takes at most this many tokens per step

    def __post_init__(self) -> None:
        for name in ("max_model_len", "num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"SchedulerConfig.long_prefill_token_threshold must be >= 0 (0 = no cap), "
                f"got {self.long_prefill_token_threshold}"
            )


class Scheduler:
    """Owns the waiting and running queues and the BlockManager; never touches tensors."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key (oldest first)
        self.running: list[Sequence] = []  # sorted by Sequence.sort_key; the last one is preempted first
        self.num_preemptions = 0
        self.num_chunked_prefills = 0
        self._groups: dict[str, SequenceGroup] = {}  # unfinished requests
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._in_flight: list[SchedulerOutput] = []  # scheduled, not yet updated, oldest first (at most 2)
        self._finished_ids: list[int] = []

    # ---- requests ---------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: Iterable[int], sampling_params: Any = None
    ) -> SequenceGroup:
        """Queue a request. Reads `sampling_params.n` (samples, default 1), `.max_tokens` (None = up to
        max_model_len) and `.prompt_logprobs` (not None: every prompt position must yield logits, so the
        request never takes a prefix-cache hit). Raises ValueError, changing nothing, if it could never run."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use; give each request a unique id")
        prompt = [int(t) for t in prompt_token_ids]
        n = getattr(sampling_params, "n", 1)
        max_tokens = getattr(sampling_params, "max_tokens", None)
        self._check_request(request_id, len(prompt), n, max_tokens)
        arrival = next(self._arrivals)
        seqs = [
            Sequence(next(self._seq_ids), request_id, list(prompt), len(prompt), sampling_params, arrival, i)
            for i in range(n)
        ]
        group = SequenceGroup(request_id, sampling_params, seqs, pending_fork=seqs[1:])
        self._groups[request_id] = group
        self.waiting.append(seqs[0])  # the newest arrival sorts last
        return group

    def abort_request(self, request_id: str) -> bool:
        """End every sequence of the request now, freeing its blocks. False if it is unknown or done."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        for seq in group.seqs:
            self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        return True

    def finish_sequence(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED_STOPPED) -> None:
        """End one sequence (the engine found a stop condition); frees its blocks. No-op if already ended."""
        if not status.is_finished:
            raise ValueError(f"finish_sequence needs a FINISHED_* status, got {status.name}")
        self._finish(seq, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=bm.usage,
            num_preemptions=self.num_preemptions,
            num_chunked_prefills=self.num_chunked_prefills,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
        )

    # ---- one step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch. Every step scheduled before must have had its `update_from_output`."""
        if self._in_flight:
            raise RuntimeError("schedule() called again before update_from_output() of the previous step")
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []

        # Running sequences, oldest first; a sequence that does not fit evicts the newest ones, then itself.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._num_new_tokens(seq, seq.num_computed_tokens, budget)
            while not bm.try_append_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim, preempted)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.PREEMPTED:
                break
            scheduled.append(
                ScheduledSequence(seq, seq.num_computed_tokens, n, n == seq.num_tokens - seq.num_computed_tokens)
            )
            budget -= n
            i += 1

        # Waiting sequences, FCFS; none after a preemption (they would only be evicted again).
        seats = len(self.running) + sum(len(self._groups[s.request_id].pending_fork) for s in self.running)
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            group = self._groups[seq.request_id]
            forks = len(group.pending_fork) if seq.sample_index == 0 else 0
            if seats + 1 + forks > self.config.max_num_seqs:
                break
            hit = self._prefix_hit(seq)
            n = self._num_new_tokens(seq, hit.num_tokens, budget)
            fork_now = forks > 0 and hit.num_tokens == seq.num_prompt_tokens - 1
            if fork_now:
                n = 1  # the prefix cache already covers the shared part: fork, then compute the last token
            if not bm.can_allocate(seq, n, hit):
                break
            self._start_running()
            if fork_now:
                bm.allocate(seq, 0, hit)
                self._fork(group, seq)  # shares only full blocks: the last token starts a fresh block
                bm.append_slots(seq, n)
            else:
                bm.allocate(seq, n, hit)
            scheduled.append(ScheduledSequence(seq, hit.num_tokens, n, hit.num_tokens + n == seq.num_tokens))
            budget -= n
            seats += 1 + forks

        self.num_chunked_prefills += sum(1 for e in scheduled if not e.sampled)
        out = SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            block_copies=bm.take_block_copies(),
            block_size=self.config.block_size,
            preempted_seq_ids=[s.seq_id for s in preempted],
            finished_seq_ids=self._finished_ids,
        )
        self._finished_ids = []
        self._in_flight.append(out)
        return out

    def schedule_continuation(self, previous: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `previous` (the only step in flight), scheduled before its tokens are known.

        Each running sequence gets what it would get once `previous` is applied: one sampled by `previous`
        decodes that token (the runner reads it on the device; row `pending_token_rows[i]` of `previous`'s
        samples), unless it ends it by length; one `previous` ran a prefill chunk of gets its next chunk; then
        waiting sequences are admitted FCFS as `schedule()` admits them. Tokens a sequence already holds are
        read from the host as usual (`pending_token_rows[i]` is -1).

        None where only `schedule()` can go on: a running sequence lacks free blocks (preemption) or would write
        a shared block (copy-on-write), a request's samples are still to fork, or nothing would run.
        `update_from_output(previous, ...)` must come first, then this step's."""
        if self._in_flight != [previous]:
            raise RuntimeError("schedule_continuation() takes the only step in flight, right after scheduling it")
        bm, bs = self.block_manager, self.config.block_size
        previous_entries: dict[int, tuple[ScheduledSequence, int]] = {}  # seq_id -> (entry, row of its sample)
        row = 0
        for entry in previous.scheduled:
            previous_entries[entry.seq.seq_id] = (entry, row if entry.sampled else -1)
            row += entry.sampled

        # Running sequences, oldest first, as they stand once `previous` is applied. Nothing changes until all
        # of them are known to fit: a decline leaves the scheduler as it was.
        budget = self.config.max_num_batched_tokens
        plan: list[tuple[Sequence, int, int, int]] = []  # (sequence, first position, new tokens, sample row)
        free = bm.get_num_free_blocks()
        ending = 0
        for seq in self.running:
            if budget == 0:
                break
            if self._group_pending_fork(seq):
                return None
            entry, sample_row = previous_entries.get(seq.seq_id, (None, -1))
            if entry is None:
                start = seq.num_computed_tokens
                n = self._num_new_tokens(seq, start, budget)
            elif sample_row >= 0:
                if self._reached_length(seq, pending=1):
                    ending += 1
                    continue
                start, n = entry.seq_len, 1  # the token `previous` samples, at position seq_len
            else:
                start = entry.seq_len
                n = self._num_new_tokens(seq, start, budget)
            fresh, copies = bm.append_needs(seq, start, start + n)
            if copies:
                return None  # a shared block would need a copy first: the regular path does that
            free -= fresh
            if free < 0:
                return None  # the regular path preempts
            plan.append((seq, start, n, sample_row))
            budget -= n

        scheduled: list[ScheduledSequence] = []
        pending_rows: list[int] = []
        for seq, start, n, sample_row in plan:
            bm.grow(seq, start + n)
            # Sampled once every token it holds (and the pending one) is computed.
            scheduled.append(ScheduledSequence(seq, start, n, start + n == seq.num_tokens + (sample_row >= 0)))
            pending_rows.append(sample_row)

        # Waiting sequences, FCFS, while they fit; a request that would fork stops admission (schedule() forks).
        # None right after a preemption, as in schedule(): they would only be evicted again.
        seats = len(self.running) - ending
        while self.waiting and budget > 0 and not previous.preempted_seq_ids:
            seq = self.waiting[0]
            if self._group_pending_fork(seq) or seats + 1 > self.config.max_num_seqs:
                break
            hit = self._prefix_hit(seq)
            n = self._num_new_tokens(seq, hit.num_tokens, budget)
            if not bm.can_allocate(seq, n, hit):
                break
            self._start_running()
            bm.allocate(seq, n, hit)
            scheduled.append(ScheduledSequence(seq, hit.num_tokens, n, hit.num_tokens + n == seq.num_tokens))
            pending_rows.append(-1)
            budget -= n
            seats += 1

        if not scheduled:
            return None
        self.num_chunked_prefills += sum(1 for e in scheduled if not e.sampled)
        out = SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            block_copies=[],
            block_size=bs,
            preempted_seq_ids=[],
            finished_seq_ids=self._finished_ids,
            pending_token_rows=pending_rows,
        )
        self._finished_ids = []
        self._in_flight.append(out)
        return out

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: list[int]) -> list[Sequence]:
        """Record the step: advance num_computed_tokens, register full blocks in the prefix cache,
        append one sampled token per `output.sampled` entry (same order), fork parallel samples whose
        shared prompt part is done. Returns the sequences this ended by length (max_tokens or
        max_model_len) with status FINISHED_LENGTH; stop conditions on content are the engine's."""
        if not self._in_flight or output is not self._in_flight[0]:
            raise ValueError("update_from_output() takes the oldest scheduled step not yet updated")
        num_sampled = sum(1 for s in output.scheduled if s.sampled)
        if len(sampled_token_ids) != num_sampled:
            raise ValueError(
                f"got {len(sampled_token_ids)} sampled token ids for {num_sampled} sampled sequences; "
                "pass one per SchedulerOutput.sampled entry, in order"
            )
        self._in_flight.pop(0)
        tokens = iter(sampled_token_ids)
        ended: list[Sequence] = []
        for entry in output.scheduled:
            seq = entry.seq
            token = int(next(tokens)) if entry.sampled else None
            if seq.status is not SequenceStatus.RUNNING:  # aborted, or stopped by the step before, while it ran
                continue
            seq.num_computed_tokens += entry.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if token is not None:
                seq.append_token(token)
                if self._reached_length(seq):
                    self._finish(seq, SequenceStatus.FINISHED_LENGTH)
                    ended.append(seq)
            elif seq.num_computed_tokens == seq.num_prompt_tokens - 1 and seq.sample_index == 0:
                group = self._groups[seq.request_id]
                if group.pending_fork:
                    self._fork(group, seq)
        return ended

    # ---- internals --------------------------------------------------------------------------------

    def _prefix_hit(self, seq: Sequence) -> PrefixHit:
        # A cached prefix would skip the logits that prompt logprobs are made of.
        if getattr(seq.sampling_params, "prompt_logprobs", None) is not None:
            return NO_HIT
        return self.block_manager.lookup_prefix(seq)

    def _start_running(self) -> Sequence:
        """Move the first waiting sequence to the running ones (its blocks are the caller's to allocate)."""
        seq = self.waiting.pop(0)
        seq.status = SequenceStatus.RUNNING
        insort(self.running, seq, key=_KEY)
        return seq

    def _num_new_tokens(self, seq: Sequence, num_computed: int, budget: int) -> int:
        n = seq.num_tokens - num_computed
        if seq.sample_index == 0 and self._groups[seq.request_id].pending_fork:
            n = max(1, seq.num_prompt_tokens - 1 - num_computed)  # the samples fork one token short
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(n, budget)

    def _fork(self, group: SequenceGroup, parent: Sequence) -> None:
        for child in group.pending_fork:
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            insort(self.running, child, key=_KEY)
        group.pending_fork = []

    def _preempt(self, seq: Sequence, preempted: list[Sequence]) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        insort(self.waiting, seq, key=_KEY)
        self.num_preemptions += 1
        preempted.append(seq)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        self._finished_ids.append(seq.seq_id)
        group = self._groups.get(seq.request_id)
        if group is None:
            return
        if seq.sample_index == 0 and group.pending_fork:  # samples that never forked end with the parent
            for child in group.pending_fork:
                child.status = status
                self._finished_ids.append(child.seq_id)
            group.pending_fork = []
        if group.is_finished:
            del self._groups[seq.request_id]

    def _reached_length(self, seq: Sequence, pending: int = 0) -> bool:
        """Whether `seq` ends by length once it holds `pending` more tokens."""
        max_tokens = getattr(seq.sampling_params, "max_tokens", None)
        if max_tokens is not None and seq.num_output_tokens + pending >= max_tokens:
            return True
        return seq.num_tokens + pending >= self.config.max_model_len

    def _group_pending_fork(self, seq: Sequence) -> bool:
        group = self._groups.get(seq.request_id)
        return group is not None and bool(group.pending_fork)

    def _check_request(self, request_id: str, prompt_len: int, n: int, max_tokens: int | None) -> None:
        cfg = self.config
        if prompt_len == 0:
            raise ValueError(f"request {request_id!r} has an empty prompt; pass at least one token id")
        if prompt_len > cfg.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {prompt_len} tokens, more than max_model_len="
                f"{cfg.max_model_len}; shorten the prompt or raise max_model_len"
            )
        if not 1 <= n <= cfg.max_num_seqs:
            raise ValueError(
                f"request {request_id!r} asks for n={n} samples; it must lie in [1, max_num_seqs="
                f"{cfg.max_num_seqs}]; lower n or raise max_num_seqs"
            )
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        # A sequence ends once it holds max_model_len tokens (a full-length prompt still gets one) or
        # max_tokens outputs; the last token is never computed, so the KV holds at most final_len - 1.
        final_len = max(cfg.max_model_len, prompt_len + 1)
        if max_tokens is not None:
            final_len = min(final_len, prompt_len + max_tokens)
        blocks = self.block_manager.num_blocks_for(final_len - 1)
        if blocks > cfg.num_blocks:
            raise ValueError(
                f"request {request_id!r}: {prompt_len} prompt tokens + up to {final_len - prompt_len} output "
                f"tokens need {blocks} KV blocks of {cfg.block_size} tokens, but the pool has num_blocks="
                f"{cfg.num_blocks}; lower max_tokens or max_model_len, or give the KV cache more memory"
            )
