"""Scheduled batches built by hand, for the tests of step inputs and their padded (CUDA-graph) buffers."""

from __future__ import annotations

import random

from tritonllm.runtime.scheduler_output import ScheduledSequence
from tritonllm.runtime.sequence import Sequence


def scheduled_batch(
    rng: random.Random, num_seqs: int, block_size: int, num_blocks: int, decode_only: bool = True
) -> list[ScheduledSequence]:
    """Sequences with scattered distinct physical blocks, each about to decode one token (sampled), or with
    `decode_only=False` a mix of decodes and prefill chunks, sampled or not."""
    free = rng.sample(range(num_blocks), num_blocks)
    batch = []
    for i in range(num_seqs):
        seq_len = rng.randint(1, 6 * block_size)  # context after the step, the new tokens included
        new = 1 if decode_only or rng.random() < 0.5 else rng.randint(1, seq_len)
        prompt = rng.randint(1, seq_len)
        tokens = [rng.randrange(1000) for _ in range(seq_len)]
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        seq = Sequence(i, str(i), tokens, prompt, None, arrival=i, block_table=table)
        seq.num_computed_tokens = seq_len - new
        sampled = decode_only or rng.random() < 0.7
        batch.append(ScheduledSequence(seq, seq_len - new, new, sampled))
    return batch
