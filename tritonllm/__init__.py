"""tritonllm: a pure-Triton, kernel-first LLM inference engine."""

from tritonllm import platform as _platform  # noqa: F401  (must precede every triton.jit)

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "register_model", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import tritonllm` stays cheap and free of import cycles.
    if name == "LLM":
        from tritonllm.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tritonllm.sampling_params import SamplingParams

        return SamplingParams
    if name == "register_model":
        from tritonllm.models.registry import register_model

        return register_model
    raise AttributeError(f"module 'tritonllm' has no attribute {name!r}")
