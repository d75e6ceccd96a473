"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as vLLM users know it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from tritonllm.outputs import RequestOutput
from tritonllm.runtime.engine import LLMEngine, PromptType
from tritonllm.runtime.engine_config import EngineConfig
from tritonllm.sampling_params import RequestOutputKind, SamplingParams

# A 4.3M-parameter Llama trained on Python's standard library, shipped inside the package
# (docs/default_model.md): what every entry point runs when no model is named.
DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "default_model")


class LLM:
    """An engine plus a loop that runs submitted prompts to completion.

    Keyword arguments are those of `EngineConfig` (dtype, quantization, max_model_len, block_size,
    gpu_memory_utilization, kv_cache_memory, num_gpu_blocks, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, seed, device, load_format, tokenizer, revision, enforce_eager, tensor_parallel_size).

    tensor_parallel_size=W > 1 starts W worker processes (spawned: a script must guard its top level with
    `if __name__ == "__main__":`); `shutdown()`, leaving a `with LLM(...)` block, or interpreter exit stops them.
    If a worker dies, `generate` raises EngineDeadError, and so does every later call (docs/distributed.md).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model or DEFAULT_MODEL, **kwargs))

    def shutdown(self) -> None:
        """Stop the engine's worker processes (if any); idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the given order. Prompts are strings, lists of token ids, or
        dicts with "prompt" or "prompt_token_ids"; one SamplingParams for all or one per prompt."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one, or one each")
        return self._run(prompts, params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template (or `chat_template`) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [
            {
                "prompt_token_ids": tokenizer.encode(
                    text := tokenizer.apply_chat_template(
                        conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template
                    ),
                    add_special_tokens=False,
                ),
                "prompt": text,
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                # Only finished requests are returned: the engine need not build outputs on every step.
                ids.append(engine.add_request(None, prompt, replace(p, output_kind=RequestOutputKind.FINAL_ONLY)))
        except Exception:
            for request_id in ids:  # all or nothing: a bad prompt leaves no request behind
                engine.abort_request(request_id)
            raise
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while engine.has_unfinished_requests() and len(finished) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]
