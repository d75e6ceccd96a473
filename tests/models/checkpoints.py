"""Tiny random checkpoints written by Hugging Face transformers, the independent reference for model tests."""

from __future__ import annotations

import os
from typing import Any

import torch

from tritonllm.models.registry import get_model_class, supported_architectures


def builtin_architectures() -> list[str]:
    """Every architecture tritonllm ships (user registrations made by other tests are left out)."""
    return [a for a in supported_architectures() if get_model_class(a).__module__.startswith("tritonllm.models.")]


def tiny_config(arch: str, **overrides: Any) -> dict[str, Any]:
    return {**get_model_class(arch).tiny_config(), **overrides}


def hf_model(config: dict[str, Any], seed: int):
    """A randomly initialised fp32 transformers model for `config` (eager attention, so sliding windows apply)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    # Norm weights start at exactly 1; perturb them so a norm applied to the wrong tensor cannot go unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model.eval()


def write_checkpoint(config: dict[str, Any], path: str | os.PathLike, seed: int, **save_kwargs: Any):
    """Save a random transformers model for `config` as safetensors under `path`; returns the model."""
    model = hf_model(config, seed)
    model.save_pretrained(os.fspath(path), safe_serialization=True, **save_kwargs)
    return model


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] fp32 logits of one sequence, full causal attention from position 0."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()
