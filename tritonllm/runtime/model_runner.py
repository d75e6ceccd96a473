"""Owns the model and its KV cache; turns a SchedulerOutput into one flat forward pass and logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tritonllm.kernels.copy_blocks import copy_blocks
from tritonllm.models.config import ModelConfig
from tritonllm.runtime.cuda_graphs import DecodeGraphRunner, capture_sizes
from tritonllm.runtime.forward_context import set_forward_context
from tritonllm.runtime.mixed_graphs import MixedGraphRunner, mixed_token_buckets
from tritonllm.runtime.scheduler_output import SchedulerOutput
from tritonllm.runtime.step_inputs import DeviceInputIds, build_step_inputs

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
        self.decode_graphs: DecodeGraphRunner | None = None  # set by capture_decode_graphs
        self.mixed_graphs: MixedGraphRunner | None = None  # likewise

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
        max_num_seqs: int = 256,
    ) -> int:
        """Blocks from, in order of precedence: an explicit count, an explicit byte budget, or (on a GPU)
        the memory left under `gpu_memory_utilization` after a profiling forward pass of a full step (and the
        fp32 logits of one row per sequence)."""
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
            self.model.compute_logits(hidden[-min(max_num_seqs, len(hidden)) :]).float()
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

    def capture_decode_graphs(
        self,
        max_num_seqs: int,
        max_model_len: int,
        use_graphs: bool = True,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        """Route decode steps of up to min(max_num_seqs, 256) sequences (and, given max_num_batched_tokens, every
        other step of up to min(max_num_batched_tokens, 8192) tokens) through padded static buffers replayed as
        CUDA graphs, captured here, after the KV cache exists. use_graphs=False keeps the padded buffers but runs
        them eagerly (any device)."""
        if self.kv_cache is None:
            raise RuntimeError("allocate the KV cache before capturing decode graphs")
        sizes = capture_sizes(max_num_seqs)
        self.decode_graphs = DecodeGraphRunner(
            self.model, self.block_size, max_model_len, sizes, self.device, use_graphs=use_graphs
        )
        self.decode_graphs.capture()
        if max_num_batched_tokens is None:
            return
        buckets = mixed_token_buckets(max_num_batched_tokens)
        self.mixed_graphs = MixedGraphRunner(
            self.model, max_model_len, self.block_size, max_num_seqs, buckets, self.device, use_graphs=use_graphs
        )
        self.mixed_graphs.capture()

    # ---- one step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        prompt_logit_seq_ids: set[int] = frozenset(),
        input_ids: DeviceInputIds | None = None,
    ) -> ModelRunnerOutput:
        """Run the step's forward pass and LM head. `input_ids`: a continuation's input tokens that the step before
        sampled and the host does not hold yet, written over their placeholders on the device."""
        if out.block_copies:
            mapping = torch.tensor(out.block_copies, dtype=torch.int64, device=self.device)
            copy_blocks(self.kv_cache, mapping)

        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(out, prompt_logit_seq_ids):
            # Every row samples: the graph's hidden states are exactly the rows to project.
            logits = self.model.compute_logits(graphs.run(out.scheduled, input_ids)).float()
            return ModelRunnerOutput(sampled_logits=logits, prompt_logits={})

        step = build_step_inputs(out.scheduled, self.block_size, self.device, prompt_logit_seq_ids)
        if input_ids is not None:
            input_ids.write_into(step.input_ids)
        meta = step.attn_metadata
        if self.mixed_graphs is not None and self.mixed_graphs.can_run(out, prompt_logit_seq_ids):
            logits = self.model.compute_logits(self.mixed_graphs.run(step)).float()
        else:
            with set_forward_context(meta):
                hidden = self.model(step.input_ids, step.positions)
            logits = self.model.compute_logits(hidden[meta.logits_indices]).float()
        num_sampled, prompt_rows = step.num_sampled, step.prompt_rows

        prompt_logits = {}
        offset = num_sampled
        for seq_id, (first_pos, _, n) in prompt_rows.items():
            prompt_logits[seq_id] = (first_pos, logits[offset : offset + n])
            offset += n
        return ModelRunnerOutput(sampled_logits=logits[:num_sampled], prompt_logits=prompt_logits)
