"""Model directories for the end-to-end benchmark (config.json + a synthetic tokenizer, weights left to
load_format="dummy"), engine construction with a timing breakdown, and the byte counts of the roofline."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tritonllm.runtime.worker as worker_module
from tritonllm.runtime.engine import LLMEngine
from tritonllm.runtime.engine_config import EngineConfig
from tritonllm.runtime.model_runner import ModelRunner

LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}

# The same architecture at toy size: a smoke run of the whole script on a CPU (Triton's interpreter) or any GPU.
TINY: dict[str, Any] = {
    **LLAMA_3_1_8B,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rope_scaling": {**LLAMA_3_1_8B["rope_scaling"], "original_max_position_embeddings": 1024},
    "bos_token_id": 0,
    "eos_token_id": [1],
}
PRESETS = {"llama-3.1-8b": LLAMA_3_1_8B, "tiny": TINY}

# 4-bit variants as AutoAWQ / AutoGPTQ write them (fp16 scales, so the model runs in fp16).
QUANT_CONFIGS: dict[str, dict[str, Any]] = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
    },
}


def write_synthetic_tokenizer(path: Path, vocab_size: int) -> None:
    """tokenizer.json of a word-level tokenizer whose token i is "t<i>": every id decodes, nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def write_model_dir(root: Path, name: str, config: dict[str, Any], quant: str | None = None) -> Path:
    """<root>/<name>/ with config.json (plus a quantization_config for quant) and the synthetic tokenizer."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    if quant is not None:
        config["quantization_config"] = dict(QUANT_CONFIGS[quant])
        config["torch_dtype"] = "float16"
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_synthetic_tokenizer(path, config["vocab_size"])
    return path


@contextlib.contextmanager
def timed_calls(device: torch.device, targets: dict[str, tuple[Any, str]]) -> Iterator[dict[str, float]]:
    """Wrap owner.attr for each label so that the seconds spent in it (device work included) land in the
    yielded dict; restored on exit."""
    timings: dict[str, float] = {}
    saved = []
    for label, (owner, attr) in targets.items():
        fn = getattr(owner, attr)
        saved.append((owner, attr, fn))

        def wrapper(*args, _fn=fn, _label=label, **kwargs):
            start = time.perf_counter()
            result = _fn(*args, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timings[_label] = timings.get(_label, 0.0) + time.perf_counter() - start
            return result

        setattr(owner, attr, wrapper)
    try:
        yield timings
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def build_engine(model_dir: Path, device: torch.device, **engine_kwargs: Any) -> tuple[LLMEngine, dict[str, Any]]:
    """An engine on dummy weights, and where its start-up time went (seconds)."""
    targets = {
        "load_s": (worker_module, "load_model"),
        "kv_profile_s": (ModelRunner, "determine_num_blocks"),
        "kv_allocate_s": (ModelRunner, "allocate_kv_cache"),
        "graph_capture_s": (ModelRunner, "capture_decode_graphs"),
    }
    with timed_calls(device, targets) as timings:
        start = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=str(model_dir), load_format="dummy", device=str(device), **engine_kwargs))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        total = time.perf_counter() - start
    runner = engine.runner
    graphs = runner.decode_graphs
    info = {
        "total_s": total,
        **{k: timings.get(k, 0.0) for k in targets},
        "num_graphs": sum(len(g.graphs) for g in (graphs, runner.mixed_graphs) if g is not None),
        "kv_cache_gib": runner.num_blocks * runner.bytes_per_block() / 2**30,
        "kv_cache_blocks": runner.num_blocks,
        "kv_cache_tokens": runner.num_blocks * runner.block_size,
    }
    return engine, info


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once, except the input embedding (a gather reads
    one row per token) unless the output head shares it, and GPTQ's g_idx (unused by the fused kernel)."""
    embeddings = {id(m.weight) for name, m in model.named_modules() if name.endswith("embed_tokens")}
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    total = 0
    for name, p in model.named_parameters():  # shared parameters come once
        if name.endswith("g_idx"):
            continue
        if id(p) in embeddings and (head is None or head is not p):
            continue
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(engine: LLMEngine) -> int:
    runner = engine.runner
    return runner.bytes_per_block() // runner.block_size
