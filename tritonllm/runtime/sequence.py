"""One generated stream (`Sequence`) and the `n` samples of one request (`SequenceGroup`).

Pure bookkeeping on ints. Who writes what:
- the scheduler: `status`, `num_computed_tokens` (advanced after each step), `token_ids` (appends samples);
- the block manager: `block_table` and `block_hashes`;
- nobody else mutates a sequence.
"""

import enum
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # queued, never run, holds no blocks
    RUNNING = enum.auto()  # admitted: holds blocks, gets tokens each step it fits in the budget
    PREEMPTED = enum.auto()  # evicted by recompute: holds no blocks, back in the waiting queue
    FINISHED_STOPPED = enum.auto()  # the engine saw a stop condition (EOS, stop token or string)
    FINISHED_LENGTH = enum.auto()  # reached max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()  # the caller aborted the request

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
)


@dataclass(slots=True, eq=False)
class Sequence:
    """token_ids = prompt + output; the first `num_computed_tokens` of them have their KV in the cache.

    Invariant while RUNNING: num_computed_tokens < num_tokens (a step always has a token to compute:
    the rest of the prompt, or the last sampled token) and `block_table` covers the computed tokens.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: Any  # opaque: only `max_tokens` is read (by the scheduler)
    arrival: int  # admission priority: smaller is older; the samples of one request share it
    sample_index: int = 0  # which of the request's n samples (seeds the sampler per sample)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the latest admission
    block_table: list[int] = field(default_factory=list)  # physical block ids, one per block_size tokens
    block_hashes: list[bytes] = field(default_factory=list, repr=False)  # chained keys of its full blocks

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def sort_key(self) -> tuple[int, int]:
        """FCFS order: older requests first, samples of one request by creation."""
        return (self.arrival, self.seq_id)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """The `n` samples of one request. They share the prompt's KV blocks through a fork.

    Only `seqs[0]` runs the prompt; it stops one token short (num_prompt_tokens - 1 computed), then the
    other samples fork from it (`pending_fork` empties) and each computes the last prompt token itself,
    so every sample gets its own logits row, and copy-on-write splits the shared last block.
    """

    request_id: str
    sampling_params: Any
    seqs: list[Sequence]
    pending_fork: list[Sequence] = field(default_factory=list)  # samples 1..n-1 until the fork

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
