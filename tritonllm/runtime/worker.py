"""One tensor-parallel rank: its device, its shard of the model, its KV cache, and (rank 0 only) the sampler.

Every rank runs every step's forward pass (the layers' collectives need them all); rank 0 alone samples and turns
logits into log-probabilities, and hands the engine a small picklable `StepResult`. With one rank the worker lives
in the engine process and takes the scheduler's own SchedulerOutput; with several, ranks rebuild it from a
`StepMessage` (`step_messages.py`).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tritonllm.distributed.communication import tp_broadcast_object
from tritonllm.distributed.parallel_state import get_tp_group, init_tensor_parallel
from tritonllm.models.loader import load_model
from tritonllm.platform import default_device
from tritonllm.runtime.engine_config import EngineConfig
from tritonllm.runtime.model_runner import ModelRunner
from tritonllm.runtime.sampler import LogprobsTensors, Sampler, SamplingMetadata, compute_prompt_logprobs
from tritonllm.runtime.scheduler_output import SchedulerOutput
from tritonllm.runtime.step_inputs import DeviceInputIds, to_device
from tritonllm.runtime.step_messages import KEEPALIVE, SHUTDOWN, SequenceMirror, StepMessage


@dataclass(slots=True)
class WorkerConfig:
    """What every rank is built from; picklable, so spawned worker processes get it as is."""

    engine: EngineConfig
    model_path: str  # a local directory (the engine resolves hub ids once, before any worker starts)
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_token_ids: frozenset[int]  # the stop tokens min_tokens bans while sampling


@dataclass(slots=True)
class StepResult:
    """Rank 0's answer to one step: no logits, only what the engine records (tensors on the CPU)."""

    sampled_token_ids: list[int]  # one per SchedulerOutput.sampled entry, in order
    logprobs: LogprobsTensors | None  # rows as sampled_token_ids; None when no sampled row asked for logprobs
    prompt_logprobs: dict[int, tuple[int, LogprobsTensors]]  # seq_id -> (first position, one row per position)

    def result(self) -> StepResult:
        """A finished step is its own result (as `PendingStep.result()` gives once the device is done)."""
        return self


def worker_device(requested: str | None, local_rank: int, world_size: int) -> torch.device:
    """The rank's device: the requested one (or the default) with one rank; cuda:{local_rank} on GPUs with more."""
    device = torch.device(requested) if requested else default_device()
    if world_size == 1 or device.type != "cuda":
        return device
    if device.index is not None:
        raise ValueError(
            f"device={requested!r} names one GPU, but tensor_parallel_size={world_size} puts rank r on cuda:r; "
            "pass device='cuda' and choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f"rank with local rank {local_rank} has no GPU: only {count} are visible on this host")
    return torch.device("cuda", local_rank)


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _min_over_ranks(value: int) -> int:
    group = get_tp_group()
    if not group.is_parallel:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(t.item())


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Start copying `t` to the host without waiting for it (pinned memory on a GPU); read it once the step's
    event has completed."""
    if t.device.type != "cuda":
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _logprobs_to_host(t: LogprobsTensors) -> LogprobsTensors:
    return LogprobsTensors(token_ids=_to_host(t.token_ids), logprobs=_to_host(t.logprobs), ranks=_to_host(t.ranks))


def continuation_input_ids(
    out: SchedulerOutput, samples: torch.Tensor | None, vocab_size: int
) -> DeviceInputIds | None:
    """The input ids of continuation `out` that `samples` (the previous step's, still on the device) hold."""
    flat_rows: list[int] = []
    sample_rows: list[int] = []
    row = 0
    for entry, sample_row in zip(out.scheduled, out.pending_token_rows, strict=True):
        if sample_row >= 0:
            flat_rows.append(row)
            sample_rows.append(sample_row)
        row += entry.num_new_tokens
    if not sample_rows:
        return None
    if samples is None:
        raise ValueError("a continuation that decodes pending tokens needs the samples of the step it continues")
    in_order = sample_rows == list(range(len(sample_rows)))  # no sampled sequence left out: a view, no gather
    values = samples[: len(sample_rows)] if in_order else samples[to_device(sample_rows, samples.device)]
    # The host checks sampled ids only once they arrive; an out-of-range one (a sampler bug) must not reach the
    # embedding gather first, where a GPU would fail with a device-side assert.
    return DeviceInputIds(values.clamp(0, vocab_size - 1), flat_rows)


class PendingStep:
    """A step whose kernels are queued on the device: its sampled tokens stay readable there by a continuation
    launched next, and `result()` waits only for this step's own copies to the host, not for later launches."""

    def __init__(
        self,
        sampled_token_ids: torch.Tensor | None,
        host_token_ids: torch.Tensor | None,
        logprobs: LogprobsTensors | None,
        prompt_logprobs: dict[int, tuple[int, LogprobsTensors]],
        device: torch.device,
    ) -> None:
        self.sampled_token_ids = sampled_token_ids  # [N] int64 on the device, None when nothing samples
        self._host_token_ids = host_token_ids
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs
        self._copied = None
        if device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(device))
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            if self._copied is not None:
                self._copied.synchronize()
            tokens = self._host_token_ids.tolist() if self._host_token_ids is not None else []
            self._result = StepResult(tokens, self._logprobs, self._prompt_logprobs)
        return self._result


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        rank: int = 0,
        world_size: int = 1,
        init_method: str = "env://",
        local_rank: int | None = None,
    ) -> None:
        engine = config.engine
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.device = worker_device(engine.device, rank if local_rank is None else local_rank, world_size)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # before the group exists: NCCL binds the current device
        elif world_size > 1:
            torch.set_num_threads(max(1, _usable_cpus() // world_size))  # ranks on one host share its cores
        if world_size > 1:
            init_tensor_parallel(rank, world_size, init_method)
        self.model, self.model_config = load_model(
            config.model_path,
            dtype=engine.dtype,
            quantization=engine.quantization,
            device=self.device,
            load_format=engine.load_format,
        )
        self.dtype = next(self.model.parameters()).dtype
        self.runner = ModelRunner(self.model, self.model_config, engine.block_size, self.device, self.dtype)
        num_blocks = self.runner.determine_num_blocks(
            engine.num_gpu_blocks,
            engine.kv_cache_memory,
            engine.gpu_memory_utilization,
            config.max_num_batched_tokens,
            config.max_num_seqs,
        )
        # Ranks may see different free memory; the scheduler's one block count must fit on every rank.
        self.runner.allocate_kv_cache(_min_over_ranks(num_blocks))
        if self.device.type == "cuda" and not engine.enforce_eager:
            self.runner.capture_decode_graphs(
                config.max_num_seqs, config.max_model_len, max_num_batched_tokens=config.max_num_batched_tokens
            )
        self.sampler = Sampler(engine.seed)
        if self.device.type == "cuda" and rank == 0:  # rank 0 alone samples
            self.sampler.warm_up(self.model_config.vocab_size, self.device)
        self.mirror = SequenceMirror()

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    # ---- one step ---------------------------------------------------------------------------------

    def execute_step(self, out: SchedulerOutput, prompt_logit_seq_ids: set[int] = frozenset()) -> StepResult | None:
        """Run the step's forward pass; on rank 0 also sample and compute the asked-for logprobs (else None)."""
        pending = self.launch_step(out, prompt_logit_seq_ids)
        return pending.result() if pending is not None else None

    def launch_step(
        self,
        out: SchedulerOutput,
        prompt_logit_seq_ids: set[int] = frozenset(),
        previous: PendingStep | None = None,
    ) -> PendingStep | None:
        """`execute_step` without waiting for the device (rank 0; other ranks return None once launched).
        A continuation (`out.pending_token_rows`) reads its input tokens from `previous`'s samples."""
        input_ids = None
        if out.is_continuation:
            samples = previous.sampled_token_ids if previous is not None else None
            input_ids = continuation_input_ids(out, samples, self.model_config.vocab_size)
        result = self.runner.execute(out, prompt_logit_seq_ids, input_ids)
        if self.rank != 0:
            return None
        tokens = host_tokens = logprobs = None
        sampled = out.sampled
        if sampled:
            seqs = [e.seq for e in sampled]
            meta = SamplingMetadata.build(
                [s.sampling_params for s in seqs],
                [s.token_ids for s in seqs],
                [s.num_prompt_tokens for s in seqs],
                result.sampled_logits.shape[1],
                eos_token_id=self.config.eos_token_ids,
                sample_indices=[s.sample_index for s in seqs],
                num_pending=[e.seq_len - e.seq.num_tokens for e in sampled] if out.is_continuation else None,
                # The pending entries are sampled ones, in the same order.
                pending_token_ids=input_ids.values if input_ids is not None else None,
                device=result.sampled_logits.device,
            )
            sampler_out = self.sampler(result.sampled_logits, meta)
            tokens = sampler_out.sampled_token_ids
            host_tokens = _to_host(tokens)
            if sampler_out.logprobs is not None:
                logprobs = _logprobs_to_host(sampler_out.logprobs)
        prompt_logprobs = {}
        if result.prompt_logits:
            by_id = {e.seq.seq_id: e.seq for e in out.scheduled}
            for seq_id, (first, logits) in result.prompt_logits.items():
                seq = by_id[seq_id]
                # Row i predicts the prompt token at first + i + 1.
                next_ids = torch.tensor(seq.token_ids[first + 1 : first + 1 + logits.shape[0]], device=logits.device)
                tensors = compute_prompt_logprobs(logits, next_ids, seq.sampling_params.prompt_logprobs)
                prompt_logprobs[seq_id] = (first, _logprobs_to_host(tensors))
        return PendingStep(tokens, host_tokens, logprobs, prompt_logprobs, self.device)

    def execute_message(self, msg: StepMessage) -> StepResult | None:
        """A step sent by the engine: update the sequence mirror, then run it."""
        return self.execute_step(self.mirror.apply(msg), msg.prompt_logit_seq_ids)

    def follow(self) -> None:
        """Ranks > 0: run each step rank 0 broadcasts until it broadcasts SHUTDOWN."""
        while True:
            msg = tp_broadcast_object(None)
            if isinstance(msg, bytes):
                msg = pickle.loads(msg)
            if msg == SHUTDOWN:
                return
            if msg != KEEPALIVE:
                self.execute_message(msg)
