"""What the engine sends tensor-parallel workers each step: the SchedulerOutput as a delta against what they know.

The scheduler lives in the engine process; the workers hold a mirror of every sequence they have run (token ids,
block table, sampling params). A `StepMessage` carries only what changed since the previous step:

    new_seqs  per sequence seen for the first time (or again after a preemption), once:
              (seq_id, token_ids, num_prompt_tokens, sampling_params, sample_index)
    entries   per scheduled sequence, in batch order:
              (seq_id, num_computed_tokens, num_new_tokens, sampled, appended_token_ids, keep, block_tail)
              appended_token_ids: tokens added since the workers last saw the sequence (a decode: the one sampled);
              the worker's block table becomes table[:keep] + block_tail.
    dropped   sequences the workers forget (finished or preempted) before applying the entries.

Why `keep = num_computed_tokens // block_size` is safe: the block manager only changes table entries at or past
the first block a step writes (appends, copy-on-write of a shared block), and blocks holding computed tokens are
never replaced while a sequence keeps running. A preempted sequence is dropped and re-sent whole. A decode step
thus costs a few ints per sequence, whatever the context length.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from tritonllm.runtime.scheduler_output import ScheduledSequence, SchedulerOutput
from tritonllm.runtime.sequence import Sequence, SequenceStatus

# Control messages, sent in place of a StepMessage.
SHUTDOWN = "shutdown"  # workers leave their loop and exit
KEEPALIVE = "keepalive"  # nothing to run: keeps an idle group's blocking broadcast inside the collective timeout

NewSequence = tuple[int, list[int], int, Any, int]
StepEntry = tuple[int, int, int, bool, list[int], int, list[int]]


@dataclass(slots=True)
class StepMessage:
    new_seqs: list[NewSequence]
    entries: list[StepEntry]
    dropped: list[int]
    block_copies: list[tuple[int, int]]
    block_size: int
    prompt_logit_seq_ids: set[int]


class StepEncoder:
    """Engine side: remembers, per sequence the workers hold, how many of its tokens they have and where its last
    step ended, and encodes each SchedulerOutput as a delta."""

    def __init__(self) -> None:
        self._sent: dict[int, list[int]] = {}  # seq_id -> [tokens sent, num_computed_tokens after its last step]
        self._dropped: list[int] = []

    def __len__(self) -> int:
        return len(self._sent)

    def discard(self, seq_ids: Iterable[int]) -> None:
        """Forget sequences (ended or preempted in a step that ran nothing); the next message drops them too."""
        for seq_id in seq_ids:
            if self._sent.pop(seq_id, None) is not None:
                self._dropped.append(seq_id)

    def encode(self, out: SchedulerOutput, prompt_logit_seq_ids: Collection[int] = frozenset()) -> StepMessage:
        self.discard(out.finished_seq_ids)
        self.discard(out.preempted_seq_ids)
        dropped, self._dropped = self._dropped, []
        bs = out.block_size
        new_seqs: list[NewSequence] = []
        entries: list[StepEntry] = []
        for e in out.scheduled:
            seq, start = e.seq, e.num_computed_tokens
            state = self._sent.get(seq.seq_id)
            table = seq.block_table
            if state is None:
                new_seqs.append(
                    (seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens, seq.sampling_params, seq.sample_index)
                )
                appended, keep = [], 0
                state = self._sent[seq.seq_id] = [0, 0]
            else:
                appended = seq.token_ids[state[0] :]
                keep = start // bs if start == state[1] else 0
            entries.append((seq.seq_id, start, e.num_new_tokens, e.sampled, appended, keep, table[keep:]))
            state[0] = seq.num_tokens
            state[1] = start + e.num_new_tokens
        return StepMessage(new_seqs, entries, dropped, out.block_copies, bs, set(prompt_logit_seq_ids))


class SequenceMirror:
    """Worker side: the sequences the engine has sent, rebuilt into a SchedulerOutput the model runner takes."""

    def __init__(self) -> None:
        self.seqs: dict[int, Sequence] = {}

    def apply(self, msg: StepMessage) -> SchedulerOutput:
        seqs = self.seqs
        for seq_id in msg.dropped:
            seqs.pop(seq_id, None)
        for seq_id, token_ids, num_prompt, params, sample_index in msg.new_seqs:
            seqs[seq_id] = Sequence(seq_id, "", token_ids, num_prompt, params, 0, sample_index, SequenceStatus.RUNNING)
        scheduled = []
        num_tokens = 0
        for seq_id, start, n, sampled, appended, keep, tail in msg.entries:
            seq = seqs[seq_id]
            if appended:
                seq.token_ids.extend(appended)
            table = seq.block_table
            del table[keep:]
            table.extend(tail)
            seq.num_computed_tokens = start
            scheduled.append(ScheduledSequence(seq, start, n, sampled))
            num_tokens += n
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=num_tokens,
            block_copies=msg.block_copies,
            block_size=msg.block_size,
            preempted_seq_ids=[],
            finished_seq_ids=[],
        )
