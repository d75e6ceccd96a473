"""Find a checkpoint's quantization format and refuse, at load time, what tritonllm cannot run.

Where the format is declared, first match wins:
  1. config.json `quantization_config` (transformers, AutoAWQ >= 0.1.7, GPTQModel, recent AutoGPTQ);
  2. `quantize_config.json` beside config.json (AutoGPTQ / GPTQModel legacy; quant_method may be absent);
  3. `quant_config.json` beside config.json (AutoAWQ legacy: w_bit, q_group_size, version).
"""

from __future__ import annotations

import json
import os
from typing import Any

from tritonllm.quant.base import QuantConfig

SUPPORTED_METHODS = ("awq", "gptq")
_LEGACY_FILES = ("quantize_config.json", "quant_config.json")


def find_quantization_config(
    config_dict: dict[str, Any], model_path: str | os.PathLike | None
) -> tuple[dict[str, Any] | None, str]:
    """(the raw quantization settings or None, a description of where they came from for messages)."""
    qc = config_dict.get("quantization_config")
    if qc:
        if not isinstance(qc, dict):
            raise ValueError(f"config.json quantization_config must be an object, got {type(qc).__name__}")
        return qc, "config.json quantization_config"
    if model_path is not None and os.path.isdir(model_path):
        for name in _LEGACY_FILES:
            path = os.path.join(model_path, name)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    qc = json.load(f)
                if not isinstance(qc, dict):
                    raise ValueError(f"{path} must hold a JSON object, got {type(qc).__name__}")
                return qc, name
    return None, "config.json"


def detect_method(qc: dict[str, Any], source: str) -> str:
    """The quantization method of raw settings: quant_method when present, else inferred from legacy keys."""
    method = qc.get("quant_method")
    if method is None:
        if "w_bit" in qc or "version" in qc or "zero_point" in qc:
            return "awq"  # AutoAWQ's own keys
        if "bits" in qc:
            return "gptq"  # AutoGPTQ's quantize_config.json predates quant_method
        raise ValueError(
            f"{source} has no 'quant_method' and does not look like AWQ or GPTQ settings; "
            f"supported quant_method values: {', '.join(SUPPORTED_METHODS)}"
        )
    method = str(method).lower()
    if method not in SUPPORTED_METHODS:
        supported = ", ".join(map(repr, SUPPORTED_METHODS))
        raise ValueError(f"{source}.quant_method={method!r} is not supported; supported: {supported}")
    return method


def get_quant_config(
    config_dict: dict[str, Any], model_path: str | os.PathLike | None, quantization: str | None = None
) -> QuantConfig | None:
    """The checkpoint's QuantConfig, or None for a dense checkpoint.

    `quantization` ("awq" / "gptq"), when given, must agree with what the checkpoint declares.
    """
    wanted = None
    if quantization is not None:
        wanted = str(quantization).lower()
        if wanted not in SUPPORTED_METHODS:
            supported = ", ".join(map(repr, SUPPORTED_METHODS))
            raise ValueError(
                f"quantization={quantization!r} is not supported; supported: {supported} "
                "(or None to detect it from the checkpoint)"
            )
    qc, source = find_quantization_config(config_dict, model_path)
    if qc is None:
        if wanted is not None:
            raise ValueError(
                f"quantization={wanted!r} was requested but the checkpoint declares no quantization (no "
                "quantization_config in config.json, no quantize_config.json or quant_config.json beside it); "
                "drop the argument to load it unquantized, or point at an AWQ/GPTQ checkpoint"
            )
        return None
    method = detect_method(qc, source)
    if wanted is not None and wanted != method:
        raise ValueError(
            f"quantization={wanted!r} was requested but {source} declares {method!r}; "
            f"pass quantization={method!r} or leave it unset to detect it"
        )
    if method == "awq":
        from tritonllm.quant.awq import AwqConfig

        return AwqConfig.from_dict(qc, source)
    from tritonllm.quant.gptq import GptqConfig

    return GptqConfig.from_dict(qc, source)
