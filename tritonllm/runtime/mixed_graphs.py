"""CUDA graphs for mixed steps (prefill chunks next to decodes): one graph per token-count bucket.

Under continuous batching almost every step of a busy server admits a prompt while the others decode, so decode
graphs alone leave most steps eager, and an eager step of a 32-layer model spends tens of milliseconds launching
kernels. A mixed step of n sequences and T tokens (T <= the largest bucket, n <= max_num_seqs) runs here instead:

    input_ids, positions, slot_mapping  [T_b] int64   rows T.. T_b: stale ids and positions, slot -1 (no KV write)
    query_start_loc                     [S + 1] int32 sequences n.. S-1 own no query tokens (start = end = T)
    seq_lens, block_tables              [S], [S, W] int32 (W: step_inputs.block_table_width); rows past n unread

with T_b the smallest bucket >= T and S = max_num_seqs. Every launch inside depends only on Python ints (T_b, S,
max_query_len = T_b, max_seq_len = max_model_len): attention plans query tiles for T_b tokens over S sequences,
and its surplus programs and the query-less sequences return at once. Rows past T are computed on stale inputs
and never read: every op but attention is row-wise, and attention reads only the KV cache, which padding rows
never write. The inputs come from `build_step_inputs` (one host-to-device copy), then a few device copies put
them into the static buffers; logits are taken outside the graph from the real rows.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Collection, Sequence

import torch
from torch import nn

from tritonllm.runtime.cuda_graphs import capture_graphs
from tritonllm.runtime.forward_context import AttentionMetadata, set_forward_context
from tritonllm.runtime.scheduler_output import SchedulerOutput
from tritonllm.runtime.step_inputs import StepInputs, block_table_width

# Above this many tokens a step is compute-bound enough that launching its kernels costs little next to them.
MIXED_TOKEN_LIMIT = 8192
_FINE_STEP, _FINE_UNTIL, _COARSE_STEP = 256, 2048, 1024


def mixed_token_buckets(max_num_batched_tokens: int, limit: int = MIXED_TOKEN_LIMIT) -> list[int]:
    """Token buckets: steps of 256 up to 2048 (where padding costs GEMM time), then steps of 1024, ending exactly
    at min(max_num_batched_tokens, limit)."""
    if max_num_batched_tokens < 1 or limit < 1:
        raise ValueError(f"max_num_batched_tokens and limit must be >= 1, got {max_num_batched_tokens} and {limit}")
    top = min(max_num_batched_tokens, limit)
    fine = range(_FINE_STEP, min(top, _FINE_UNTIL + 1), _FINE_STEP)
    coarse = range(_FINE_UNTIL + _COARSE_STEP, top, _COARSE_STEP)
    return sorted({*(s for s in (*fine, *coarse) if s < top), top})


class MixedGraphRunner:
    """Runs steps of up to `buckets[-1]` tokens and `max_num_seqs` sequences from static buffers: replaying a CUDA
    graph per token bucket once `capture()` has run (CUDA only), or eagerly from the same buffers
    (`use_graphs=False`, any device)."""

    def __init__(
        self,
        model: nn.Module,
        max_model_len: int,
        block_size: int,
        max_num_seqs: int,
        buckets: Sequence[int],
        device: torch.device,
        use_graphs: bool = True,
    ) -> None:
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"token buckets must be ascending, distinct and >= 1, got {list(buckets)}")
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}; pass use_graphs=False")
        self.model = model
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.buckets = list(buckets)
        self.device = device
        self.use_graphs = use_graphs
        t, s = self.buckets[-1], max_num_seqs
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(s + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(s, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(s, block_table_width(max_blocks), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> the graph's static hidden states [T_b, H]
        self.capture_seconds = 0.0

    def bucket_for(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    def can_run(self, out: SchedulerOutput, prompt_logit_seq_ids: Collection[int] = frozenset()) -> bool:
        """Fits the buffers, and no sequence wants prompt logits (their rows vary in number: eager)."""
        return (
            0 < out.num_batched_tokens <= self.buckets[-1]
            and len(out.scheduled) <= self.max_num_seqs
            and not any(e.seq.seq_id in prompt_logit_seq_ids for e in out.scheduled)
        )

    def _metadata(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            max_query_len=bucket,
            max_seq_len=self.max_model_len,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping[:bucket],
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        with set_forward_context(self._metadata(bucket)):
            return self.model(self.input_ids[:bucket], self.positions[:bucket])

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture one graph per bucket, largest first, into one shared memory pool. The buffers hold
        padding only (every slot -1, no query tokens), so capture writes nothing to the KV cache."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        self.graphs, self.outputs = capture_graphs(self._forward, self.buckets, self.device)
        self.capture_seconds = time.perf_counter() - start

    def _fill(self, step: StepInputs, bucket: int) -> None:
        meta = step.attn_metadata
        t, n = step.input_ids.shape[0], meta.num_seqs
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(
                f"a block table of {width} blocks exceeds the {self.block_tables.shape[1]} that max_model_len allows"
            )
        self.input_ids[:t].copy_(step.input_ids)
        self.positions[:t].copy_(step.positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.slot_mapping[t:bucket].fill_(-1)
        self.query_start_loc[: n + 1].copy_(meta.query_start_loc)
        self.query_start_loc[n + 1 :].copy_(meta.query_start_loc[n:].expand(self.max_num_seqs - n))
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor:
        """Hidden states of the step's logits rows (`step.attn_metadata.logits_indices`); valid until the next run."""
        t = step.input_ids.shape[0]
        bucket = self.bucket_for(t)
        if bucket is None or step.attn_metadata.num_seqs > self.max_num_seqs:
            raise ValueError(f"a step of {t} tokens does not fit the mixed-step buffers; run it eagerly")
        self._fill(step, bucket)
        graph = self.graphs.get(bucket)
        if graph is None:
            if self.use_graphs:
                raise RuntimeError("mixed-step graphs are not captured yet; call capture() after the KV cache exists")
            hidden = self._forward(bucket)
        else:
            graph.replay()
            hidden = self.outputs[bucket]
        return hidden[step.attn_metadata.logits_indices]
