"""Round-to-nearest quantization of a whole float checkpoint into AWQ or GPTQ format.

No calibration data: each linear projection is quantized on its own with per-group min/max scales
(`tritonllm.quant.pack`). The result is a checkpoint directory in the tools' own layout that loads through
the normal detection path, useful to try the 4-bit kernels on any model and to measure what rounding costs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tritonllm.models.loader import iterate_safetensors, resolve_model_path
from tritonllm.quant.pack import pack_awq, pack_gptq

# Projections of a Llama-family decoder layer; lm_head and embeddings stay in float.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Files copied verbatim from the source checkpoint.
_EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def rtn_settings(method: str, group_size: int = 128, bits: int = 4, sym: bool = True) -> dict[str, Any]:
    """The quantization_config a round-to-nearest checkpoint carries."""
    if method == "awq":
        if bits != 4:
            raise ValueError(f"AWQ checkpoints are 4-bit; got bits={bits}")
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "sym": sym,
            "desc_act": False,
            "static_groups": False,
            "checkpoint_format": "gptq",
        }
    raise ValueError(f"method must be 'awq' or 'gptq', got {method!r}")


def quantize_checkpoint(src: str, dst: str | Path, settings: dict[str, Any]) -> Path:
    """Write `src` (a float checkpoint directory or hub id) quantized per `settings` (see `rtn_settings`) to `dst`."""
    src_path = Path(resolve_model_path(src))
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    method, group_size = settings["quant_method"], settings["group_size"]
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iterate_safetensors(str(src_path)):
        module, _, kind = name.rpartition(".")
        if kind != "weight" or module.rsplit(".", 1)[-1] not in PROJECTIONS:
            tensors[name] = tensor.contiguous()
            continue
        weight = tensor.float()  # [N, K]
        if weight.shape[1] % group_size:
            raise ValueError(
                f"{name} has K={weight.shape[1]} input features, not a multiple of group_size={group_size}; "
                "choose a group size that divides every projection's input size"
            )
        if method == "awq":
            packed = pack_awq(weight, group_size)
            parts = {"qweight": packed.qweight, "qzeros": packed.qzeros, "scales": packed.scales}
        else:
            packed = pack_gptq(weight, settings["bits"], group_size, settings["sym"], settings["checkpoint_format"])
            parts = {"qweight": packed.qweight, "qzeros": packed.qzeros, "scales": packed.scales, "g_idx": packed.g_idx}
        for suffix, t in parts.items():
            tensors[f"{module}.{suffix}"] = t.contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})

    config = json.loads((src_path / "config.json").read_text())
    config["quantization_config"] = settings
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in _EXTRA_FILES:
        if (src_path / name).exists():
            shutil.copy(src_path / name, dst / name)
    return dst
