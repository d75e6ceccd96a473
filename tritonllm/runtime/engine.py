"""The engine: requests in, one scheduled step at a time, RequestOutputs out.

add_request ─▶ Scheduler.add_request            (validation, queueing)
step():  Scheduler.schedule ─▶ ModelRunner.execute ─▶ Sampler ─▶ Scheduler.update_from_output
         ─▶ stop checks + detokenization ─▶ RequestOutput for every request that moved
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from dataclasses import dataclass, field, replace

import torch

from tritonllm.models.loader import load_model, resolve_model_path
from tritonllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, logprobs_dict
from tritonllm.platform import default_device
from tritonllm.runtime.detokenizer import IncrementalDetokenizer
from tritonllm.runtime.engine_config import EngineConfig
from tritonllm.runtime.model_runner import ModelRunner
from tritonllm.runtime.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs
from tritonllm.runtime.scheduler import Scheduler, SchedulerConfig
from tritonllm.runtime.scheduler_output import SchedulerStats
from tritonllm.runtime.sequence import Sequence, SequenceGroup, SequenceStatus
from tritonllm.runtime.tokenizer import Tokenizer
from tritonllm.sampling_params import SamplingParams

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
        device = torch.device(config.device) if config.device else default_device()
        path = resolve_model_path(config.model, config.revision)
        self.model, self.model_config = load_model(
            path,
            dtype=config.dtype,
            quantization=config.quantization,
            device=device,
            load_format=config.load_format,
        )
        self.tokenizer = Tokenizer(config.tokenizer or path)
        self.eos_token_ids = eos_token_ids(path, self.model_config.eos_token_ids, self.tokenizer.eos_token_id)
        self.dtype = next(self.model.parameters()).dtype
        self.max_model_len = config.resolve_max_model_len(self.model_config.max_position_embeddings)
        max_batched = config.max_num_batched_tokens or max(config.DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len)
        self.runner = ModelRunner(self.model, self.model_config, config.block_size, device, self.dtype)
        num_blocks = self.runner.determine_num_blocks(
            config.num_gpu_blocks, config.kv_cache_memory, config.gpu_memory_utilization, max_batched
        )
        self.runner.allocate_kv_cache(num_blocks)
        if device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=self.max_model_len,
                num_blocks=num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max_batched,
                enable_prefix_caching=config.enable_prefix_caching,
            )
        )
        self.sampler = Sampler(config.seed)
        # Requests without a seed get one from this generator at arrival, so that a preempted request
        # re-samples exactly what it would have, and a whole run is reproducible from the engine seed.
        self._seed_rng = random.Random(config.seed)
        self._requests: dict[str, RequestState] = {}
        self._request_ids = itertools.count()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

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
                detokenizer=IncrementalDetokenizer(self.tokenizer, params, ids),
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
        return bool(self._requests)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    # ---- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch. Returns the state of every request that produced something."""
        out = self.scheduler.schedule()
        if out.is_empty:
            self.scheduler.update_from_output(out, [])
            return []
        wants_prompt_logits = {
            e.seq.seq_id
            for e in out.scheduled
            if self._requests[e.seq.request_id].prompt_logprobs is not None and e.seq.sample_index == 0
        }
        result = self.runner.execute(out, wants_prompt_logits)
        sampled = out.sampled
        token_ids: list[int] = []
        sampler_out = None
        if sampled:
            seqs = [e.seq for e in sampled]
            meta = SamplingMetadata.build(
                [s.sampling_params for s in seqs],
                [s.prompt_token_ids for s in seqs],
                [s.output_token_ids for s in seqs],
                result.sampled_logits.shape[1],
                eos_token_id=self.eos_token_ids,
                sample_indices=[s.sample_index for s in seqs],
                device=result.sampled_logits.device,
            )
            sampler_out = self.sampler(result.sampled_logits, meta)
            token_ids = sampler_out.sampled_token_ids.tolist()
            self._check_sampled(token_ids)

        for seq_id, (first_pos, logits) in result.prompt_logits.items():
            self._record_prompt_logprobs(out, seq_id, first_pos, logits)
        self.scheduler.update_from_output(out, token_ids)

        now = time.perf_counter()
        touched: dict[str, RequestState] = {}
        for row, (entry, token) in enumerate(zip(sampled, token_ids, strict=True)):
            seq = entry.seq
            state = self._requests.get(seq.request_id)
            if state is None:
                continue
            touched[state.request_id] = state
            state.token_times.append(now)
            if state.first_token_time is None:
                state.first_token_time = now
            self.num_generation_tokens_total += 1
            sample = state.samples[seq.seq_id]
            if sampler_out is not None and sampler_out.logprobs is not None and sample.logprobs is not None:
                self._record_logprobs(sample, sampler_out.logprobs, row, state.params.logprobs)
            self._check_stop(seq, sample, token, state.params)
        for entry in out.scheduled:
            state = self._requests.get(entry.seq.request_id)
            if state is not None and state.prompt_logprobs is not None:
                touched[state.request_id] = state

        outputs = [self._make_output(state) for state in touched.values()]
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

    def _record_prompt_logprobs(self, out, seq_id: int, first_pos: int, logits: torch.Tensor) -> None:
        entry = next(e for e in out.scheduled if e.seq.seq_id == seq_id)
        state = self._requests.get(entry.seq.request_id)
        if state is None or state.prompt_logprobs is None:
            return
        # After a preemption the prompt is recomputed; positions already recorded are skipped.
        have = len(state.prompt_logprobs) - 1  # positions 0 .. have - 1 already predicted
        skip = max(0, have - first_pos)
        if skip >= logits.shape[0]:
            return
        next_ids = torch.tensor(
            state.prompt_token_ids[first_pos + 1 + skip : first_pos + 1 + logits.shape[0]], device=logits.device
        )
        k = state.params.prompt_logprobs
        tensors = compute_prompt_logprobs(logits[skip:], next_ids, k)
        for row in range(tensors.token_ids.shape[0]):
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
