"""The flat inputs of one eager step (token ids, positions, AttentionMetadata), moved to the device in one copy.

Every integer of the step is written into one host buffer (pinned on a GPU, so the copy is asynchronous and
the CPU never waits for the GPU here), copied once, and the int32 fields are cast in one more device op:

    int64 buffer: input_ids [T] | positions [T] | slot_mapping [T] | logits_indices [L] | int32 part
    int32 part:   query_start_loc [B + 1] | seq_lens [B] | block_tables [B * W]

Each field starts 16 bytes into its buffer times a whole number (zeros pad the one before), and block table rows
hold a whole number of 16 entries (`block_table_width`, the graphs' static tables too): Triton specializes kernels
on whether a pointer is 16-byte aligned and whether an integer (the table's row stride) is a multiple of 16, so
offsets and widths that follow the batch would give an eager step's kernels variants the captured graphs never
compiled, built in the middle of a run.
"""

from __future__ import annotations

import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from tritonllm.runtime.forward_context import AttentionMetadata
from tritonllm.runtime.scheduler_output import ScheduledSequence


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata  # logits_indices: the sampled rows first, then every prompt-logit row
    num_sampled: int  # rows of logits_indices that belong to sampled sequences (out.sampled order)
    prompt_rows: dict[int, tuple[int, int, int]]  # seq_id -> (first position, first row, rows) of prompt logits


# Elements per 16 bytes: the alignment Triton specializes pointers on.
_ALIGN_INT64 = 2
_ALIGN_INT32 = 4
# The multiple Triton specializes integer arguments on.
_TABLE_WIDTH_MULTIPLE = 16


def block_table_width(num_blocks: int) -> int:
    """Entries per block table row for tables of up to `num_blocks` blocks: the next multiple of 16."""
    return -(-num_blocks // _TABLE_WIDTH_MULTIPLE) * _TABLE_WIDTH_MULTIPLE


def _append_aligned(values: list[int], field: Sequence[int], align: int) -> int:
    """Append `field` to `values` at the next multiple of `align` (zeros fill the gap); returns where it begins."""
    values.extend([0] * (-len(values) % align))
    start = len(values)
    values.extend(field)
    return start


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 tensor on `device` from a host list, without a host sync on a GPU (pinned, non-blocking copy;
    PyTorch's pinned-memory cache keeps the host buffer alive until the copy has run)."""
    # Through array.array: about 3x faster than torch.tensor(list) for the ~10^4 ints of a large step.
    host = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    pinned = torch.empty(host.shape, dtype=torch.int64, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)


@dataclass(slots=True)
class DeviceInputIds:
    """Input ids that reach a step on the device (a continuation's tokens, sampled by the step still running):
    `values[i]` is the input id of the step's flat token row `rows[i]`."""

    values: torch.Tensor  # [len(rows)] int64, on the step's device
    rows: list[int]

    def write_into(self, input_ids: torch.Tensor) -> None:
        """Overwrite those rows of a step's flat `input_ids` (its placeholders) on the device."""
        n = len(self.rows)
        if self.rows == list(range(n)):  # every sequence decodes a pending token: a slice, no scatter
            input_ids[:n].copy_(self.values)
        else:
            input_ids[to_device(self.rows, input_ids.device)] = self.values


def build_step_inputs(
    scheduled: Sequence[ScheduledSequence],
    block_size: int,
    device: torch.device,
    prompt_logit_seq_ids: Collection[int] = frozenset(),
) -> StepInputs:
    """Flatten the scheduled sequences (in order) into one batch.

    Sequence i computes positions num_computed_tokens .. seq_len - 1; each token's KV slot is
    block_table[p // block_size] * block_size + p % block_size. Sampled sequences get the logits of their last
    token; sequences in `prompt_logit_seq_ids` also get those of the prompt positions computed this step
    (except the last prompt token, whose logits predict the first output).
    """
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    sampled_rows: list[int] = []
    prompt_rows: dict[int, tuple[int, int, int]] = {}
    bs = block_size
    for entry in scheduled:
        start, n = entry.num_computed_tokens, entry.num_new_tokens
        end = start + n
        table = entry.block_table
        seq = entry.seq
        row0 = query_start_loc[-1]
        if n == 1:  # decode: skip the range and slicing machinery
            # start == num_tokens: a continuation's token, still being sampled; the runner patches it on the device
            ids.append(seq.token_ids[start] if start < seq.num_tokens else 0)
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        query_start_loc.append(row0 + n)
        seq_lens.append(end)
        if entry.sampled:
            sampled_rows.append(row0 + n - 1)
        if seq.seq_id in prompt_logit_seq_ids and start < seq.num_prompt_tokens - 1:
            prompt_rows[seq.seq_id] = (start, row0, min(end, seq.num_prompt_tokens - 1) - start)

    num_sampled = len(sampled_rows)
    logits_indices = sampled_rows  # extended in place: sampled rows first, then prompt-logit rows
    for _, row0, n in prompt_rows.values():
        logits_indices.extend(range(row0, row0 + n))

    num_tokens, num_seqs = len(ids), len(seq_lens)
    width = block_table_width(max(len(e.block_table) for e in scheduled))
    flat_tables: list[int] = []
    for entry in scheduled:
        table = entry.block_table
        flat_tables.extend(table)
        flat_tables.extend([0] * (width - len(table)))  # padding: never read (past the sequence's blocks)

    host: list[int] = []
    ids_at, positions_at, slots_at, logits_at = (
        _append_aligned(host, field, _ALIGN_INT64) for field in (ids, positions, slots, logits_indices)
    )
    # The int32 part's offsets count from here (the cast below starts a new tensor): a multiple of _ALIGN_INT32, so
    # its fields' places in `host` and in that tensor are aligned alike.
    host.extend([0] * (-len(host) % _ALIGN_INT32))
    small_at = len(host)
    qsl_at, lens_at, tables_at = (
        _append_aligned(host, field, _ALIGN_INT32) - small_at for field in (query_start_loc, seq_lens, flat_tables)
    )
    buf = to_device(host, device)
    t, n_logits = num_tokens, len(logits_indices)
    small = buf[small_at:].to(torch.int32)
    meta = AttentionMetadata(
        query_start_loc=small[qsl_at : qsl_at + num_seqs + 1],
        seq_lens=small[lens_at : lens_at + num_seqs],
        max_query_len=max(e.num_new_tokens for e in scheduled),
        max_seq_len=max(seq_lens),
        block_tables=small[tables_at : tables_at + num_seqs * width].view(num_seqs, width),
        slot_mapping=buf[slots_at : slots_at + t],
        logits_indices=buf[logits_at : logits_at + n_logits],
    )
    return StepInputs(
        input_ids=buf[ids_at : ids_at + t],
        positions=buf[positions_at : positions_at + t],
        attn_metadata=meta,
        num_sampled=num_sampled,
        prompt_rows=prompt_rows,
    )
