"""The flat inputs of an eager step: every field holds what the scheduled sequences say, every field starts on a
16-byte boundary and block table rows hold a multiple of 16 entries whatever the batch's sizes (Triton specializes
kernels on pointer alignment and on integer arguments being multiples of 16)."""

from __future__ import annotations

import random

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import seeds
from tests.runtime.scheduled_batches import scheduled_batch
from tritonllm.runtime.cuda_graphs import DecodeInputs
from tritonllm.runtime.step_inputs import block_table_width, build_step_inputs


@given(seed=seeds(), num_seqs=st.integers(1, 13), block_size=st.sampled_from([1, 2, 4, 16]), logits=st.booleans())
def test_fields_hold_the_batch_and_start_16_byte_aligned(seed, num_seqs, block_size, logits):
    rng = random.Random(seed)
    batch = scheduled_batch(rng, num_seqs, block_size, num_blocks=80, decode_only=False)
    prompt_logits = {e.seq.seq_id for e in batch if logits and rng.random() < 0.5}
    step = build_step_inputs(batch, block_size, torch.device("cpu"), prompt_logits)
    meta = step.attn_metadata

    fields = dict(
        input_ids=step.input_ids,
        positions=step.positions,
        slot_mapping=meta.slot_mapping,
        logits_indices=meta.logits_indices,
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        block_tables=meta.block_tables,
    )
    misaligned = {name: t.data_ptr() % 16 for name, t in fields.items() if t.data_ptr() % 16}
    assert not misaligned, f"fields off a 16-byte boundary (bytes past it): {misaligned}"

    positions = [p for e in batch for p in range(e.num_computed_tokens, e.seq_len)]
    assert step.input_ids.tolist() == [t for e in batch for t in e.new_token_ids]
    assert step.positions.tolist() == positions
    tables = [e.seq.block_table for e in batch]
    owners = [i for i, e in enumerate(batch) for _ in range(e.num_new_tokens)]
    slots = [tables[i][p // block_size] * block_size + p % block_size for i, p in zip(owners, positions, strict=True)]
    assert meta.slot_mapping.tolist() == slots
    starts = [0]
    for e in batch:
        starts.append(starts[-1] + e.num_new_tokens)
    assert meta.query_start_loc.tolist() == starts
    assert meta.seq_lens.tolist() == [e.seq_len for e in batch]
    width = max(len(t) for t in tables)
    assert meta.block_tables.shape[0] == num_seqs
    assert meta.block_tables.stride(0) % 16 == 0 and width <= meta.block_tables.shape[1] < width + 16
    for row, table in zip(meta.block_tables.tolist(), tables, strict=True):
        assert row[: len(table)] == table
    sampled = [starts[i + 1] - 1 for i, e in enumerate(batch) if e.sampled]
    assert meta.logits_indices.tolist()[: step.num_sampled] == sampled
    assert meta.max_query_len == max(e.num_new_tokens for e in batch)
    assert meta.max_seq_len == max(e.seq_len for e in batch)


@given(max_blocks=st.integers(1, 300), max_size=st.integers(1, 9))
def test_decode_graph_tables_share_the_eager_row_stride_class(max_blocks, max_size):
    # The graphs' static table is as wide as max_model_len allows, rounded the way eager steps round theirs: the
    # attention kernels of both see a row stride that is a multiple of 16, so they share compiled variants.
    inputs = DecodeInputs(max_size, max_blocks, torch.device("cpu"))
    assert inputs.block_tables.stride(0) == block_table_width(max_blocks)
    assert block_table_width(max_blocks) % 16 == 0 and max_blocks <= block_table_width(max_blocks) < max_blocks + 16
