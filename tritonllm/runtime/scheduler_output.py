"""What one scheduler step hands to the model runner, and the scheduler's counters."""

from dataclasses import dataclass

from tritonllm.runtime.sequence import Sequence


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step: compute tokens num_computed_tokens .. seq_len - 1.

    Their context (positions < num_computed_tokens) is already in the KV cache; their own KV goes to
    slots `BlockManager.get_slot_ids(seq, num_computed_tokens, seq_len)` of `seq.block_table`.
    """

    seq: Sequence
    num_computed_tokens: int  # in the KV cache before the step (prefix hit, earlier chunks, decode history)
    num_new_tokens: int  # computed this step (>= 1): a prefill chunk, or 1 for a decode
    sampled: bool  # after this step every token is computed: take logits of the last new token, sample

    @property
    def seq_len(self) -> int:
        """Context length after the step (AttentionMetadata.seq_lens)."""
        return self.num_computed_tokens + self.num_new_tokens

    @property
    def new_token_ids(self) -> list[int]:
        """Input ids of the step, at positions num_computed_tokens .. seq_len - 1."""
        return self.seq.token_ids[self.num_computed_tokens : self.seq_len]

    @property
    def block_table(self) -> list[int]:
        """Physical blocks of the sequence; valid until the next `Scheduler.schedule()`."""
        return self.seq.block_table


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch. The runner, in order:

    1. copies each `block_copies` (src, dst) KV block, all layers, K and V (`kernels.copy_blocks`);
    2. runs `scheduled` as one flat batch, in this order (query_start_loc follows it);
    3. samples one token for each entry of `sampled`, in that order, and passes them to
       `Scheduler.update_from_output`.
    `finished_seq_ids` and `preempted_seq_ids` let it drop per-sequence state (a preempted sequence
    comes back later with num_computed_tokens == 0 and new blocks).
    """

    scheduled: list[ScheduledSequence]
    num_batched_tokens: int  # sum of num_new_tokens, <= max_num_batched_tokens
    block_copies: list[tuple[int, int]]  # copy-on-write (src, dst): distinct dsts, no block both src and dst
    block_size: int
    preempted_seq_ids: list[int]  # preempted during this schedule() call
    finished_seq_ids: list[int]  # ended (stopped, length, aborted) since the previous schedule() call
    # A continuation (`Scheduler.schedule_continuation`): where pending_token_rows[i] >= 0, entry i decodes the
    # token that row of the previous step's samples holds, not yet in its token_ids (the runner reads it on the
    # device); -1: entry i's tokens are all in its token_ids.
    pending_token_rows: list[int] | None = None

    @property
    def sampled(self) -> list[ScheduledSequence]:
        return [s for s in self.scheduled if s.sampled]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def is_continuation(self) -> bool:
        return self.pending_token_rows is not None


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int  # queued or preempted sequences
    kv_cache_usage: float  # fraction of KV blocks not available to allocations
    num_preemptions: int  # since start
    num_chunked_prefills: int  # scheduled prompt parts that stopped short of the end (chunked prefill), since start
    prefix_cache_queries: int  # prompt tokens looked up at admission, since start
    prefix_cache_hits: int  # of those, tokens served from the cache

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
