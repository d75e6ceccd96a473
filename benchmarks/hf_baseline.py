"""The end-to-end benchmark's baseline: Hugging Face transformers `generate()` with static batches.

Requests run in arrival order, `batch_size` at a time, left-padded to the longest prompt of the batch; every row
generates as many tokens as the longest output of its batch (min_new_tokens = max_new_tokens, greedy), and only
each request's own output length counts as useful. Weights are random (N(0, 0.02), norms 1), as the engine's.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tritonllm.entrypoints.bench import BenchRequest


def _from_config(config, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    except TypeError:  # transformers < 4.56 names it torch_dtype
        return AutoModelForCausalLM.from_config(config, torch_dtype=dtype, attn_implementation="sdpa")


def load_hf_model(model_dir: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device(device):
        model = _from_config(config, dtype)
    with torch.no_grad():
        g = torch.Generator(device=device).manual_seed(0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def _generate(model, batch: list[BenchRequest], device: torch.device) -> int:
    """Run one static batch; returns the tokens generated per row."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
        mask[i, width - n :] = 1
    new = max(r.output_len for r in batch)
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    generated = out.shape[1] - width
    if generated != new:
        raise RuntimeError(f"transformers generated {generated} tokens instead of {new}")
    return generated


def hf_static_batching(
    model_dir: Path,
    workload: list[BenchRequest],
    batch_size: int,
    dtype: torch.dtype,
    device: torch.device,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    import transformers

    log(f"transformers {transformers.__version__}: building the model on {device} ...")
    model = load_hf_model(model_dir, dtype, device)
    with torch.inference_mode():
        warm = [BenchRequest(r.prompt_token_ids, 4, 0.0) for r in workload[:2]]
        _generate(model, warm, device)  # warm-up (cuBLAS handles, allocator)
        batches = [workload[i : i + batch_size] for i in range(0, len(workload), batch_size)]
        elapsed = 0.0
        generated = 0
        for i, batch in enumerate(batches):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            per_row = _generate(model, batch, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            elapsed += seconds
            generated += per_row * len(batch)
            log(f"transformers batch {i + 1}/{len(batches)}: {len(batch)} x {per_row} tokens in {seconds:.1f} s")
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    useful = sum(r.output_len for r in workload)
    return {
        "transformers_version": transformers.__version__,
        "num_requests": len(workload),
        "batch_size": batch_size,
        "duration_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": useful,
        "generated_tokens": generated,  # padding rows' extra tokens included
        "requests_per_s": len(workload) / elapsed,
        "output_tokens_per_s": useful / elapsed,
        "total_tokens_per_s": (prompt_tokens + useful) / elapsed,
    }
