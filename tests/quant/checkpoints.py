"""Tiny quantized checkpoints in the tools' own layout, built from a random transformers model.

Each projection (q/k/v/o, gate/up/down) is quantized on its own, as AutoAWQ / AutoGPTQ / GPTQModel do, and saved
under its Hugging Face name (`...q_proj.qweight`, `.qzeros`, `.scales`, GPTQ also `.g_idx`). The transformers model
is then given the dequantized weights, so it is the float reference for the quantized checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from tests.models.checkpoints import hf_model
from tritonllm.quant.pack import dequantize_awq, dequantize_gptq, pack_awq, pack_gptq

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def awq_settings(group_size: int) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}


def gptq_settings(bits: int, group_size: int, sym: bool, desc_act: bool, checkpoint_format: str) -> dict[str, Any]:
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "sym": sym,
        "desc_act": desc_act,
        "static_groups": False,
        "checkpoint_format": checkpoint_format,
        "damp_percent": 0.01,
        "true_sequential": True,
    }


def _quantize(
    weight: torch.Tensor, settings: dict[str, Any], seed: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Checkpoint tensors for one projection weight [N, K], and the float weight they dequantize to."""
    g = settings["group_size"]
    if settings["quant_method"] == "awq":
        t = pack_awq(weight, g)
        tensors = {"qweight": t.qweight, "qzeros": t.qzeros, "scales": t.scales}
        return tensors, dequantize_awq(t.qweight, t.qzeros, t.scales, g).t()
    bits, fmt = settings["bits"], settings["checkpoint_format"]
    gen = torch.Generator().manual_seed(seed)
    t = pack_gptq(weight, bits, g, settings["sym"], fmt, act_order=settings["desc_act"], generator=gen)
    tensors = {"qweight": t.qweight, "qzeros": t.qzeros, "scales": t.scales, "g_idx": t.g_idx}
    return tensors, dequantize_gptq(t.qweight, t.qzeros, t.scales, t.g_idx, bits, fmt).t()


def write_quantized_checkpoint(
    config: dict[str, Any],
    settings: dict[str, Any],
    path: str | os.PathLike,
    seed: int,
    legacy_file: str | None = None,
    skip: tuple[str, ...] = (),
):
    """Write a quantized checkpoint of a random model for `config` under `path`; return the transformers model
    holding the dequantized weights. `legacy_file` puts the settings there instead of config.json; projections
    named in `skip` stay dense (listed in modules_to_not_convert)."""
    model = hf_model(config, seed)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, (name, module) in enumerate(model.named_modules()):
            if name.rsplit(".", 1)[-1] not in PROJECTIONS or any(s in name for s in skip):
                continue
            packed, dequantized = _quantize(module.weight.float(), settings, seed + i)
            for suffix, t in packed.items():
                tensors[f"{name}.{suffix}"] = t.contiguous()
            module.weight.copy_(dequantized)
    for name, p in model.state_dict().items():
        base = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and f"{base}.qweight" in tensors:
            continue
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        tensors[name] = p.detach().clone().contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    settings = dict(settings)
    if skip:
        settings["modules_to_not_convert"] = list(skip)
    cfg = model.config.to_dict()
    if legacy_file is None:
        cfg["quantization_config"] = settings
    else:
        with open(os.path.join(path, legacy_file), "w", encoding="utf-8") as f:
            json.dump(settings, f)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return model.eval()
