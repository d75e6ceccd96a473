"""Owns the model and its KV cache; turns a SchedulerOutput into one flat forward pass and logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tritonllm.kernels.copy_blocks import copy_blocks
from tritonllm.models.config import ModelConfig
from tritonllm.runtime.forward_context import AttentionMetadata, set_forward_context
from tritonllm.runtime.scheduler_output import SchedulerOutput

# Without a GPU there is nothing to profile; the cache gets a fixed budget unless the caller sets one.
DEFAULT_CPU_KV_CACHE_MEMORY = 256 * 2**20


@dataclass(slots=True)
class ModelRunnerOutput:
    """Logits of one step, all fp32.

    sampled_logits: [len(out.sampled), vocab], one row per sampled sequence in `out.sampled` order.
    prompt_logits: seq_id -> (first position, [n, vocab]): for sequences that asked for prompt logits, the
        logits at each prompt position computed this step (row i predicts the token at position first + i + 1).
    """

    sampled_logits: torch.Tensor
    prompt_logits: dict[int, tuple[int, torch.Tensor]]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.attention_layers = model.attention_layers()
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0

    # ---- KV cache ---------------------------------------------------------------------------------

    def bytes_per_block(self) -> int:
        layer = self.attention_layers[0]
        per_layer = 2 * self.block_size * layer.num_kv_heads * layer.head_size
        return per_layer * len(self.attention_layers) * torch.finfo(self.dtype).bits // 8

    def determine_num_blocks(
        self,
        num_gpu_blocks: int | None,
        kv_cache_memory: int | None,
        gpu_memory_utilization: float,
        max_num_batched_tokens: int,
    ) -> int:
        """Blocks from, in order of precedence: an explicit count, an explicit byte budget, or (on a GPU)
        the memory left under `gpu_memory_utilization` after a profiling forward pass of a full step."""
        if num_gpu_blocks is not None:
            return num_gpu_blocks
        if kv_cache_memory is not None:
            return kv_cache_memory // self.bytes_per_block()
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_MEMORY // self.bytes_per_block()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        ids = torch.zeros(max_num_batched_tokens, dtype=torch.int64, device=self.device)
        with torch.inference_mode(), set_forward_context(None):
            hidden = self.model(ids, ids)
            self.model.compute_logits(hidden[-min(256, len(hidden)) :])
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        in_use_by_others = total - free - torch.cuda.memory_reserved(self.device)
        available = int(total * gpu_memory_utilization) - peak - in_use_by_others
        torch.cuda.empty_cache()
        if available <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache: the model takes {peak / 2**30:.2f} GiB at peak of "
                f"{total / 2**30:.2f} GiB; raise gpu_memory_utilization (now {gpu_memory_utilization}) "
                "or lower max_num_batched_tokens"
            )
        return available // self.bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor [2, layers, num_blocks, block_size, kv_heads, head_size]; each layer gets its views."""
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget holds no block of {self.bytes_per_block()} bytes; "
                "raise kv_cache_memory / num_gpu_blocks / gpu_memory_utilization"
            )
        layer = self.attention_layers[0]
        shape = (2, len(self.attention_layers), num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
        # Zeroed so that padding slots never hold NaN bit patterns.
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.num_blocks = num_blocks
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache = self.kv_cache[0, i]
            attn.v_cache = self.kv_cache[1, i]

    # ---- one step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, prompt_logit_seq_ids: set[int] = frozenset()) -> ModelRunnerOutput:
        if out.block_copies:
            mapping = torch.tensor(out.block_copies, dtype=torch.int64, device=self.device)
            copy_blocks(self.kv_cache, mapping)

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        prompt_rows: dict[int, tuple[int, int, int]] = {}  # seq_id -> (first position, first row, rows)
        bs = self.block_size
        for entry in out.scheduled:
            start, end = entry.num_computed_tokens, entry.seq_len
            table = entry.block_table
            input_ids.extend(entry.new_token_ids)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            row0 = query_start_loc[-1]
            query_start_loc.append(row0 + end - start)
            seq_lens.append(end)
            seq = entry.seq
            if seq.seq_id in prompt_logit_seq_ids and start < seq.num_prompt_tokens - 1:
                n = min(end, seq.num_prompt_tokens - 1) - start
                prompt_rows[seq.seq_id] = (start, row0, n)
        for entry, row_end in zip(out.scheduled, query_start_loc[1:], strict=True):
            if entry.sampled:
                logits_indices.append(row_end - 1)

        num_sampled = len(logits_indices)
        for _, row0, n in prompt_rows.values():
            logits_indices.extend(range(row0, row0 + n))

        max_blocks = max(len(e.block_table) for e in out.scheduled)
        block_tables = [e.block_table + [0] * (max_blocks - len(e.block_table)) for e in out.scheduled]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=max(e.num_new_tokens for e in out.scheduled),
            max_seq_len=max(seq_lens),
            block_tables=torch.tensor(block_tables, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        with set_forward_context(meta):
            hidden = self.model(ids, pos)
        logits = self.model.compute_logits(hidden[meta.logits_indices]).float()

        prompt_logits = {}
        offset = num_sampled
        for seq_id, (first_pos, _, n) in prompt_rows.items():
            prompt_logits[seq_id] = (first_pos, logits[offset : offset + n])
            offset += n
        return ModelRunnerOutput(sampled_logits=logits[:num_sampled], prompt_logits=prompt_logits)
