"""Per-step attention metadata, handed to Attention layers without threading it through models."""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one flat batch: sequence i owns query tokens query_start_loc[i]:query_start_loc[i+1].

    The query tokens of a sequence are its last `query_len` tokens: positions seq_len - query_len .. seq_len - 1.
    Everything before them is already in the KV cache (prefix cache hit, earlier chunk, or decode history).
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths, starts at 0
    seq_lens: torch.Tensor  # [num_seqs] int32, tokens in context after this step (cached + new)
    max_query_len: int  # max over sequences of the new tokens this step
    max_seq_len: int  # max over sequences of seq_lens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, physical block ids; padding unused
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot (block * block_size + offset) per token; -1 = skip
    logits_indices: torch.Tensor | None = None  # [num_logits] int64, rows of the hidden states to project

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(slots=True)
class ForwardContext:
    # None for a run with no KV cache bound (a memory-profiling pass): Attention skips the cache.
    attn_metadata: AttentionMetadata | None


_context: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None) -> Iterator[ForwardContext]:
    global _context
    previous = _context
    _context = ForwardContext(attn_metadata)
    try:
        yield _context
    finally:
        _context = previous


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("no forward context: run the model inside `with set_forward_context(metadata):`")
    return _context
