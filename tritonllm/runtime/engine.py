"""The engine: requests in, one scheduled step at a time, RequestOutputs out.

add_request ─▶ Scheduler.add_request            (validation, queueing)
step():  Scheduler.schedule ─▶ Executor.launch_step (every rank: forward; rank 0: sample, logprobs)
         [─▶ Scheduler.schedule_continuation ─▶ Executor.launch_step: the next step, queued behind this one]
         ─▶ wait for this step's tokens ─▶ Scheduler.update_from_output ─▶ stop checks + detokenization
         ─▶ RequestOutput for every request that moved

With asynchronous scheduling (one rank), a step that a continuation follows returns while the GPU runs that
continuation; the next step() call collects it. So the host's bookkeeping overlaps the GPU's work, and the GPU
does not wait for the host between decode steps.

The scheduler runs here, once; the model runs in the executor's workers (in this process for one rank). When the
executor dies (a tensor-parallel worker exited), every request in flight fails with its EngineDeadError and every
later call raises it.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from dataclasses import dataclass, field, replace

import torch

from tritonllm.models.config import ModelConfig
from tritonllm.models.loader import resolve_model_path
from tritonllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, logprobs_dict
from tritonllm.platform import device_memory
from tritonllm.runtime.detokenizer import IncrementalDetokenizer
from tritonllm.runtime.engine_config import EngineConfig
from tritonllm.runtime.errors import EngineDeadError
from tritonllm.runtime.executor import Executor, create_executor
from tritonllm.runtime.sampler import LogprobsTensors
from tritonllm.runtime.scheduler import Scheduler, SchedulerConfig
from tritonllm.runtime.scheduler_output import SchedulerOutput, SchedulerStats
from tritonllm.runtime.sequence import Sequence, SequenceGroup, SequenceStatus
from tritonllm.runtime.tokenizer import Tokenizer
from tritonllm.runtime.worker import PendingStep, StepResult, WorkerConfig
from tritonllm.sampling_params import RequestOutputKind, SamplingParams

_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}

PromptType = str | list[int] | dict


@dataclass(slots=True)
class SampleState:
    """Per generated sequence: its text, logprobs and how it ended."""

    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    group: SequenceGroup
    samples: dict[int, SampleState]  # seq_id -> state
    prompt_logprobs: PromptLogprobs | None
    arrival_time: float
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = resolve_model_path(config.model, config.revision)
        self.model_config = ModelConfig.from_file(path)
        self.tokenizer = Tokenizer(config.tokenizer or path)
        self.eos_token_ids = eos_token_ids(path, self.model_config.eos_token_ids, self.tokenizer.eos_token_id)
        self.max_model_len = config.resolve_max_model_len(self.model_config.max_position_embeddings)
        max_num_seqs, max_batched = config.batch_limits(device_memory(config.device))
        self.dead_error: EngineDeadError | None = None
        # Loads the model on every rank and sizes the KV cache. In a torchrun launch, ranks > 0 stay in here.
        self.executor: Executor = create_executor(
            WorkerConfig(config, path, self.max_model_len, max_num_seqs, max_batched, self.eos_token_ids)
        )
        num_blocks = self.executor.num_blocks
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=self.max_model_len,
                num_blocks=num_blocks,
                block_size=config.block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_batched,
                enable_prefix_caching=config.enable_prefix_caching,
            )
        )
        # Requests without a seed get one from this generator at arrival, so that a preempted request
        # re-samples exactly what it would have, and a whole run is reproducible from the engine seed.
        self._seed_rng = random.Random(config.seed)
        self._requests: dict[str, RequestState] = {}
        self._request_ids = itertools.count()
        # A continuation launched by the previous step() call, collected by the next: (its output, its launch).
        self._ahead: tuple[SchedulerOutput, PendingStep] | None = None
        self._continues = config.async_scheduling and self.executor.supports_continuation
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

    # ---- the workers ------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.executor.dtype

    @property
    def device(self) -> torch.device:
        """Rank 0's device."""
        return self.executor.device

    @property
    def num_blocks(self) -> int:
        return self.executor.num_blocks

    def _driver(self):
        worker = self.executor.driver_worker
        if worker is None:
            raise AttributeError(
                f"with tensor_parallel_size={self.config.tensor_parallel_size} the model, runner and sampler live "
                "in worker processes, not in the engine"
            )
        return worker

    @property
    def runner(self):
        """The in-process rank-0 ModelRunner (one rank, or a torchrun driver)."""
        return self._driver().runner

    @property
    def model(self):
        return self._driver().model

    @property
    def sampler(self):
        return self._driver().sampler

    @sampler.setter
    def sampler(self, sampler) -> None:
        self._driver().sampler = sampler

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine failed, was shut down, or lost a worker. Never blocks."""
        if self.dead_error is not None:
            raise self.dead_error
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the workers (idempotent); the engine then refuses every call with EngineDeadError."""
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine is shut down")
        self._requests.clear()
        self._ahead = None
        self.executor.shutdown()

    def _die(self, error: EngineDeadError) -> None:
        """The executor is gone: every request in flight ends (its caller gets `error`), later calls raise it."""
        self.dead_error = error
        self._ahead = None
        for request_id in list(self._requests):
            self.scheduler.abort_request(request_id)
        self._requests.clear()

    # ---- requests ---------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return str(next(self._request_ids))

    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (a list of ints)")
        if isinstance(prompt, list | tuple):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_sampled(self, token_ids: list[int]) -> None:
        """An id outside the vocabulary would reach the next step's embedding gather (on a GPU, a device-side
        assert that ends the process); stop here instead. Reads the host list the step fetched anyway: no sync."""
        vocab = self.model_config.vocab_size
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
            bad = [t for t in token_ids if not 0 <= t < vocab]
            raise RuntimeError(
                f"the sampler returned token ids {bad[:5]} outside the vocabulary [0, {vocab}); they were not fed "
                "to the model. A sampler bug: even NaN or infinite logits must give ids in range"
            )

    def _check_token_ids(self, ids) -> list[int]:
        vocab = self.model_config.vocab_size
        if not isinstance(ids, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return list(ids)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None) -> str:
        """Queue a request; raises ValueError (changing nothing) for a prompt or parameters it could never run."""
        if self.dead_error is not None:
            raise self.dead_error
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = self.new_request_id() if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use; give each request a unique id")
        text, ids = self.encode_prompt(prompt)
        rng_state = self._seed_rng.getstate()
        if params.seed is None:
            params = replace(params, seed=self._seed_rng.getrandbits(63))
        try:
            group = self.scheduler.add_request(request_id, ids, params)
        except ValueError:
            self._seed_rng.setstate(rng_state)  # a rejected request must not shift the seeds of later ones
            raise
        samples = {}
        for seq in group.seqs:
            samples[seq.seq_id] = SampleState(
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, params, ids, lazy=params.output_kind is RequestOutputKind.FINAL_ONLY
                ),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
        prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self._requests[request_id] = RequestState(
            request_id, text, ids, params, group, samples, prompt_logprobs, time.perf_counter()
        )
        self.num_prompt_tokens_total += len(ids)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or already finished."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self.scheduler.abort_request(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests not yet finished, or a step still running (the next step() call collects it)."""
        return bool(self._requests) or self._ahead is not None

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    # ---- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch. Returns the state of every request that produced something."""
        if self.dead_error is not None:
            raise self.dead_error
        try:
            if self._ahead is not None:
                (out, pending), self._ahead = self._ahead, None
            else:
                out = self.scheduler.schedule()
                if out.is_empty:
                    self.scheduler.update_from_output(out, [])
                    self.executor.discard(out.finished_seq_ids + out.preempted_seq_ids)
                    return []
                pending = self.executor.launch_step(out, self._wants_prompt_logits(out))
            if self._continues:
                following = self.scheduler.schedule_continuation(out)
                if following is not None:
                    launched = self.executor.launch_step(following, self._wants_prompt_logits(following), pending)
                    self._ahead = (following, launched)
            result = pending.result()
        except EngineDeadError as e:
            self._die(e)
            raise
        return self._process(out, result)

    def _wants_prompt_logits(self, out: SchedulerOutput) -> set[int]:
        return {
            e.seq.seq_id
            for e in out.scheduled
            if self._requests[e.seq.request_id].prompt_logprobs is not None and e.seq.sample_index == 0
        }

    def _process(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Apply one finished step: scheduler bookkeeping, stop checks, logprobs, outputs."""
        token_ids = result.sampled_token_ids
        self._check_sampled(token_ids)
        sampled = out.sampled
        # A sequence the step before ended (on content, while this continuation ran) computed one token too many.
        live = [e.seq.status is SequenceStatus.RUNNING for e in sampled]
        for seq_id, (first_pos, tensors) in result.prompt_logprobs.items():
            self._record_prompt_logprobs(out, seq_id, first_pos, tensors)
        self.scheduler.update_from_output(out, token_ids)

        now = time.perf_counter()
        touched: dict[str, RequestState] = {}
        for row, (entry, token) in enumerate(zip(sampled, token_ids, strict=True)):
            seq = entry.seq
            state = self._requests.get(seq.request_id)
            if state is None or not live[row]:
                continue
            touched[state.request_id] = state
            state.token_times.append(now)
            if state.first_token_time is None:
                state.first_token_time = now
            self.num_generation_tokens_total += 1
            sample = state.samples[seq.seq_id]
            if result.logprobs is not None and sample.logprobs is not None:
                self._record_logprobs(sample, result.logprobs, row, state.params.logprobs)
            self._check_stop(seq, sample, token, state.params)
        for entry in out.scheduled:
            state = self._requests.get(entry.seq.request_id)
            if state is not None and state.prompt_logprobs is not None:
                touched[state.request_id] = state

        outputs = [
            self._make_output(state)
            for state in touched.values()
            if state.params.output_kind is not RequestOutputKind.FINAL_ONLY or state.group.is_finished
        ]
        for o in outputs:
            if o.finished:
                self._requests.pop(o.request_id, None)
        return outputs

    def _check_stop(self, seq: Sequence, sample: SampleState, token: int, params: SamplingParams) -> None:
        """Stop tokens (any EOS id unless ignore_eos, and stop_token_ids; the sampler bans them before
        min_tokens), then stop strings in the detokenized text."""
        stop_token = token in params.stop_token_set(self.eos_token_ids)
        if stop_token:
            sample.stop_reason = token if token in params.stop_token_ids else None
        ended_by_length = seq.status is SequenceStatus.FINISHED_LENGTH
        stop_str = sample.detokenizer.update([token], stop_terminated=stop_token, finished=ended_by_length)
        if stop_str is not None:
            sample.stop_reason = stop_str
        if not (stop_token or stop_str is not None):
            return
        if ended_by_length:
            # The last allowed token was also a stop: report the stop. Its blocks are already free.
            seq.status = SequenceStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_sequence(seq, SequenceStatus.FINISHED_STOPPED)

    def _record_logprobs(self, sample: SampleState, tensors, row: int, k: int) -> None:
        ids = tensors.token_ids[row, : k + 1].tolist()
        lps = tensors.logprobs[row, : k + 1].tolist()
        rank = int(tensors.ranks[row])
        sample.logprobs.append(logprobs_dict(ids, lps, rank, self._decode_token))
        sample.cumulative_logprob += lps[0]

    def _record_prompt_logprobs(self, out, seq_id: int, first_pos: int, tensors: LogprobsTensors) -> None:
        entry = next(e for e in out.scheduled if e.seq.seq_id == seq_id)
        state = self._requests.get(entry.seq.request_id)
        if state is None or state.prompt_logprobs is None:
            return
        # After a preemption the prompt is recomputed; positions already recorded are skipped.
        have = len(state.prompt_logprobs) - 1  # positions 0 .. have - 1 already predicted
        k = state.params.prompt_logprobs
        for row in range(max(0, have - first_pos), tensors.token_ids.shape[0]):
            ids = tensors.token_ids[row, : k + 1].tolist()
            lps = tensors.logprobs[row, : k + 1].tolist()
            state.prompt_logprobs.append(logprobs_dict(ids, lps, int(tensors.ranks[row]), self._decode_token))

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _make_output(self, state: RequestState) -> RequestOutput:
        completions = []
        for index, seq in enumerate(state.group.seqs):
            sample = state.samples[seq.seq_id]
            finish_reason = _FINISH_REASONS.get(seq.status)
            completions.append(
                CompletionOutput(
                    index=index,
                    text=sample.detokenizer.get_next_output_text(finished=finish_reason is not None),
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=sample.cumulative_logprob,
                    logprobs=sample.logprobs,
                    finish_reason=finish_reason,
                    stop_reason=sample.stop_reason if finish_reason == "stop" else None,
                )
            )
        prompt_logprobs = state.prompt_logprobs
        if prompt_logprobs is not None and len(prompt_logprobs) < len(state.prompt_token_ids):
            prompt_logprobs = None  # still being computed
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=all(c.finish_reason is not None for c in completions),
        )


def eos_token_ids(model_path: str, config_eos: list[int], tokenizer_eos: int | None) -> frozenset[int]:
    """Every id that ends generation as EOS: the tokenizer's eos_token, config.json's eos_token_id and
    generation_config.json's (each may list several, as Llama 3's do)."""
    ids = set(config_eos)
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    gen_file = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file, encoding="utf-8") as f:
            value = json.load(f).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else value or [])
    return frozenset(ids)
