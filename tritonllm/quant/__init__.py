"""Weight formats: AWQ and GPTQ checkpoints detected from config.json, run through tritonllm's Triton kernels."""

from tritonllm.quant.base import LinearMethod, QuantConfig

__all__ = [
    "AwqConfig",
    "AwqLinearMethod",
    "GptqConfig",
    "GptqLinearMethod",
    "LinearMethod",
    "QuantConfig",
    "get_quant_config",
]

_LAZY = {
    "AwqConfig": "tritonllm.quant.awq",
    "AwqLinearMethod": "tritonllm.quant.awq",
    "GptqConfig": "tritonllm.quant.gptq",
    "GptqLinearMethod": "tritonllm.quant.gptq",
    "get_quant_config": "tritonllm.quant.config",
}


def __getattr__(name: str):
    # Lazy: tritonllm.quant.base is imported by every model layer, and the formats pull in Triton kernels.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tritonllm.quant' has no attribute {name!r}")
