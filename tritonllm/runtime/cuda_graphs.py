"""CUDA graphs for decode steps: capture the model's forward once per batch-size bucket, replay it every step.

A step qualifies when every scheduled sequence computes exactly one token and samples it (no prompt logits)
and the batch fits the largest bucket. Its n sequences are padded to the smallest bucket B >= n; the graph of
B reads static input buffers, which each step overwrites:

    input_ids, positions, slot_mapping  [B] int64   padding rows: token 0, position 0, slot -1 (writes nothing)
    query_start_loc                     [B + 1]     int32, always 0, 1, ..., B (one query token per row)
    seq_lens                            [B] int32   padding rows: 1, so they attend to one key and stay finite
    block_tables                        [B, W] int32, W = cdiv(max_model_len, block_size) rounded up to a multiple
                                        of 16 (as eager steps' tables); padding rows point at block 0 (any block is
                                        valid to read)

The attention kernel's launch depends only on Python ints (tokens, sequences, max_query_len = 1, max_seq_len =
max_model_len), so one graph serves every context length. Graphs share one memory pool and are captured from
the largest bucket down, so the smaller ones reuse its memory. Capture runs with every slot at -1: it never
writes the KV cache. Without CUDA (or with capture off) the same padded buffers run the model eagerly, which
lets CPU tests check the padding through the real kernels.
"""

from __future__ import annotations

import array
import bisect
import gc
import time
from collections.abc import Callable, Collection, Sequence

import numpy as np
import torch
from torch import nn

from tritonllm.runtime.forward_context import AttentionMetadata, set_forward_context
from tritonllm.runtime.scheduler_output import ScheduledSequence, SchedulerOutput
from tritonllm.runtime.step_inputs import DeviceInputIds, block_table_width

# Above this many sequences a decode step is compute-heavy enough that launch overhead no longer matters.
CAPTURE_SIZE_LIMIT = 256
_SMALL_SIZES = (1, 2, 4)
_SIZE_STEP = 8


def capture_sizes(max_num_seqs: int, limit: int = CAPTURE_SIZE_LIMIT) -> list[int]:
    """Bucket sizes 1, 2, 4, 8, 16, 24, 32, ... (steps of 8), ending exactly at min(max_num_seqs, limit)."""
    if max_num_seqs < 1 or limit < 1:
        raise ValueError(f"max_num_seqs and limit must be >= 1, got {max_num_seqs} and {limit}")
    top = min(max_num_seqs, limit)
    sizes = [s for s in (*_SMALL_SIZES, *range(_SIZE_STEP, top, _SIZE_STEP)) if s < top]
    return [*sizes, top]


def padded_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding num_seqs sequences (sizes sorted ascending), or None if none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def capture_graphs(
    forward: Callable[[int], torch.Tensor], sizes: Sequence[int], device: torch.device
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
    """Warm up and capture forward(size) for each size, largest first, into one shared memory pool; returns the
    graphs and their static outputs by size.

    Python's garbage collector stays off while capturing: a collection that frees an unreachable graph (of an engine
    dropped earlier) destroys it inside this capture, which CUDA refuses and which invalidates the capture."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, torch.Tensor] = {}
    pool = torch.cuda.graph_pool_handle()
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        for size in sorted(sizes, reverse=True):
            forward(size)  # compiles this shape's kernels outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[size] = forward(size)
            graphs[size] = graph
        torch.cuda.synchronize(device)
    finally:
        if collecting:
            gc.enable()
    return graphs, outputs


def is_decode_step(out: SchedulerOutput, prompt_logit_seq_ids: Collection[int] = frozenset()) -> bool:
    """Every scheduled sequence computes one token and samples it, and none wants prompt logits."""
    return bool(out.scheduled) and all(
        e.num_new_tokens == 1 and e.sampled and e.seq.seq_id not in prompt_logit_seq_ids for e in out.scheduled
    )


class DecodeInputs:
    """Static device buffers of the largest bucket, their pinned host mirrors, and the per-step fill.

    Host layout, copied in two transfers per step:
        tokens [3, max_size] int64:   input_ids | positions | slot_mapping
        small  [max_size + max_size * max_blocks] int32: seq_lens | block tables of this step, [B, W] row-major
    The second copy lands in a device staging area; one device copy scatters the [B, W] tables into
    block_tables[:B, :W]. W is the widest block table of the step, so a long max_model_len costs nothing.
    """

    def __init__(self, max_size: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_size = max_size
        self.max_blocks = max_blocks_per_seq
        self.device = device
        pin = device.type == "cuda"
        small_len = max_size + max_size * max_blocks_per_seq
        self.host_tokens = torch.zeros(3, max_size, dtype=torch.int64, pin_memory=pin)
        self.host_small = torch.zeros(small_len, dtype=torch.int32, pin_memory=pin)
        self.tokens = torch.zeros(3, max_size, dtype=torch.int64, device=device)
        self.small = torch.zeros(small_len, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)
        width = block_table_width(max_blocks_per_seq)
        self.block_tables = torch.zeros(max_size, width, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.tokens[0], self.tokens[1], self.tokens[2]
        self.seq_lens = self.small[:max_size]
        # Capture-time contents: all padding.
        self.tokens[2].fill_(-1)
        self.seq_lens.fill_(1)
        # The host buffers are reused; a step waits for the previous step's copies before overwriting them.
        self._copied = torch.cuda.Event() if pin else None

    def metadata(self, size: int, max_model_len: int) -> AttentionMetadata:
        """Views of the first `size` rows, as the graph of that bucket sees them."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            max_query_len=1,
            max_seq_len=max_model_len,
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
        )

    def fill(self, scheduled: Sequence[ScheduledSequence], size: int, block_size: int) -> None:
        """Write one decode step (len(scheduled) <= size sequences, one new token each) padded to `size` rows."""
        n = len(scheduled)
        if not 0 < n <= size <= self.max_size:
            raise ValueError(f"a decode batch of {n} sequences does not fit a bucket of {size} (max {self.max_size})")
        ids, positions, slots, seq_lens, tables = decode_rows(scheduled, block_size, size)
        width = max(len(t) for t in tables)
        if width > self.max_blocks:
            raise ValueError(
                f"a block table of {width} blocks exceeds the {self.max_blocks} that max_model_len allows; "
                "the scheduler must cap sequences at max_model_len"
            )
        flat: list[int] = []
        for table in tables:
            flat += table
            flat += [0] * (width - len(table))
        if self._copied is not None:
            self._copied.synchronize()
        host = self.host_tokens.numpy()
        host[0, :size] = ids
        host[1, :size] = positions
        host[2, :size] = slots
        small = self.host_small.numpy()
        small[:size] = seq_lens
        # Through array.array: a list converts to an int32 buffer faster than numpy converts it.
        small[self.max_size : self.max_size + size * width] = np.frombuffer(array.array("i", flat), dtype=np.int32)
        end = self.max_size + size * width
        non_blocking = self._copied is not None
        self.tokens.copy_(self.host_tokens, non_blocking=non_blocking)
        staged = self.small[:end]
        staged.copy_(self.host_small[:end], non_blocking=non_blocking)
        self.block_tables[:size, :width].copy_(staged[self.max_size :].view(size, width))
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))


def decode_rows(
    scheduled: Sequence[ScheduledSequence], block_size: int, size: int
) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
    """(input_ids, positions, slot_mapping, seq_lens, block tables), `size` rows each: the decode sequences
    in order, then padding rows (token 0, position 0, slot -1, seq_len 1, table [0])."""
    bs = block_size
    ids, positions, slots, seq_lens, tables = [], [], [], [], []
    for e in scheduled:
        p = e.num_computed_tokens  # the one new token's position
        table = e.block_table
        token_ids = e.seq.token_ids
        ids.append(token_ids[p] if p < len(token_ids) else 0)  # a continuation's token: patched on the device
        positions.append(p)
        slots.append(table[p // bs] * bs + p % bs)
        seq_lens.append(p + 1)
        tables.append(table)
    pad = size - len(scheduled)
    return ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad, seq_lens + [1] * pad, tables + [[0]] * pad


class DecodeGraphRunner:
    """Runs decode steps of `model` from static padded buffers: replaying a CUDA graph per bucket once
    `capture()` has run (CUDA only), or eagerly from the same buffers (`use_graphs=False`, any device)."""

    def __init__(
        self,
        model: nn.Module,
        block_size: int,
        max_model_len: int,
        sizes: Sequence[int],
        device: torch.device,
        use_graphs: bool = True,
    ) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"bucket sizes must be ascending, distinct and >= 1, got {list(sizes)}")
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}; pass use_graphs=False")
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = list(sizes)
        self.device = device
        self.use_graphs = use_graphs
        self.inputs = DecodeInputs(self.sizes[-1], -(-max_model_len // block_size), device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> the graph's static hidden states [B, H]
        self.capture_seconds = 0.0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, out: SchedulerOutput, prompt_logit_seq_ids: Collection[int] = frozenset()) -> bool:
        return len(out.scheduled) <= self.max_size and is_decode_step(out, prompt_logit_seq_ids)

    def _forward(self, size: int) -> torch.Tensor:
        inputs = self.inputs
        with set_forward_context(inputs.metadata(size, self.max_model_len)):
            return self.model(inputs.input_ids[:size], inputs.positions[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture one graph per bucket, largest first, into one shared memory pool."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        self.graphs, self.outputs = capture_graphs(self._forward, self.sizes, self.device)
        self.capture_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def run(self, scheduled: Sequence[ScheduledSequence], input_ids: DeviceInputIds | None = None) -> torch.Tensor:
        """Hidden states [len(scheduled), H] of one decode step; valid until the next run. `input_ids`, when given,
        replaces the input tokens of those rows (a continuation of a step still running)."""
        n = len(scheduled)
        size = padded_size(n, self.sizes)
        if size is None:
            raise ValueError(f"{n} sequences exceed the largest bucket ({self.max_size}); run the step eagerly")
        self.inputs.fill(scheduled, size, self.block_size)
        if input_ids is not None:
            input_ids.write_into(self.inputs.input_ids)
        graph = self.graphs.get(size)
        if graph is None:
            if self.use_graphs:
                raise RuntimeError("decode graphs are not captured yet; call capture() after the KV cache exists")
            return self._forward(size)[:n]
        graph.replay()
        return self.outputs[size][:n]
