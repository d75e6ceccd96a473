"""A tiny random Llama in Hugging Face format (transformers-written weights + the tiny BPE tokenizer), engines
over it, and the references engine tests compare with: each request run alone, and transformers' logits."""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
import threading
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from tests.models.checkpoints import tiny_config, write_checkpoint
from tests.runtime.tiny_tokenizer import build_tokenizer_dir
from tritonllm.outputs import CompletionOutput, RequestOutput
from tritonllm.runtime.engine import LLMEngine
from tritonllm.runtime.engine_config import EngineConfig
from tritonllm.sampling_params import SamplingParams

VOCAB = 420  # the tiny tokenizer's vocabulary, special tokens included
BOS, EOS = 0, 1  # "<s>", "</s>" in the tiny tokenizer
FIRST_PLAIN_TOKEN = 6  # ids below are special tokens

# Two layers, GQA (2 query heads per KV head), untied head. initializer_range 0.4 (not 0.02) makes the output
# depend on the whole context, with clear argmax margins; at 0.02 a random Llama just repeats its last token,
# which would hide any attention bug.
MODEL_CONFIG: dict[str, Any] = tiny_config(
    "LlamaForCausalLM",
    vocab_size=VOCAB,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    initializer_range=0.4,
    tie_word_embeddings=False,
    bos_token_id=BOS,
    eos_token_id=EOS,
    max_position_embeddings=128,
)

# Small blocks so that short prompts span several; a pool big enough for any one test request alone.
ENGINE_DEFAULTS: dict[str, Any] = dict(block_size=4, num_gpu_blocks=48, seed=0)


@lru_cache(maxsize=1)
def _checkpoint() -> tuple[Path, torch.nn.Module]:
    path = Path(tempfile.mkdtemp(prefix="tritonllm-tiny-llama-"))
    hf = write_checkpoint(MODEL_CONFIG, path, seed=0)
    build_tokenizer_dir(path)
    return path, hf


def tiny_model_dir() -> Path:
    """The checkpoint directory: config.json, generation_config.json, model.safetensors, tokenizer files."""
    return _checkpoint()[0]


def hf_model() -> torch.nn.Module:
    """The transformers model that wrote the checkpoint (fp32, eager): the independent reference."""
    return _checkpoint()[1]


def variant_dir(name: str, config: dict | None = None, generation_config: dict | None = None) -> Path:
    """A copy of the checkpoint directory with entries of config.json / generation_config.json replaced."""
    src = tiny_model_dir()
    dst = src.parent / f"{src.name}-{name}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for file, overrides in (("config.json", config), ("generation_config.json", generation_config)):
        if overrides:
            data = json.loads((dst / file).read_text())
            data.update(overrides)
            (dst / file).write_text(json.dumps(data))
    return dst


def make_engine(model: Path | None = None, **overrides: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model or tiny_model_dir()), **{**ENGINE_DEFAULTS, **overrides}))


def run_to_completion(engine: LLMEngine, max_steps: int = 500) -> dict[str, RequestOutput]:
    """Step until every request has finished; returns the final output of each, by request id."""
    finished: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, f"request {out.request_id} finished twice"
                finished[out.request_id] = out
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def random_prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (length,), generator=g).tolist()


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


_ALONE: dict[tuple[tuple[int, ...], str], CompletionOutput] = {}


def run_alone(prompt: list[int], params: SamplingParams) -> CompletionOutput:
    """The request's one completion when it is the only one in a fresh engine (cached: tests share them)."""
    assert params.n == 1
    key = (tuple(prompt), repr(params))
    if key not in _ALONE:
        engine = make_engine()
        engine.add_request("alone", list(prompt), params)
        (out,) = run_to_completion(engine).values()
        _ALONE[key] = out.outputs[0]
    return _ALONE[key]


def hf_logprobs(token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] fp32 log_softmax of transformers' logits; row i predicts token i + 1."""
    with torch.no_grad():
        logits = hf_model()(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def free_blocks_equal_total(engine: LLMEngine) -> bool:
    bm = engine.scheduler.block_manager
    return bm.get_num_free_blocks() == bm.num_blocks and not any(bm.ref_counts)


def fresh_thread(test: Callable) -> Callable:
    """Run a test body on a new thread with one intra-op torch thread; both only for speed under the interpreter.

    CPython 3.11 keeps frames in 16 KiB chunks and unmaps a chunk as soon as the stack drops back below it. Under
    pytest + hypothesis the interpreter's hot path sits at a chunk edge and maps and unmaps one per Triton op
    (about a million mmap calls per engine test, half the run time); a new thread's stack starts empty. The tiny
    matmuls gain nothing from a second OpenMP thread, which on busy cores stalls every op until it is scheduled.
    """

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        errors: list[BaseException] = []

        def body() -> None:
            try:
                test(*args, **kwargs)
            except BaseException as e:  # re-raised on the calling thread, traceback included
                errors.append(e)

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            worker = threading.Thread(target=body, name=test.__name__)
            worker.start()
            worker.join()
        finally:
            torch.set_num_threads(threads)
        if errors:
            raise errors[0]

    return run
