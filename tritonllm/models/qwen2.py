"""Qwen2 / Qwen2.5: Llama with a bias on q, k, v (not o) and Qwen2's per-layer sliding-window rule."""

from __future__ import annotations

from typing import Any

from tritonllm.models.config import ModelConfig
from tritonllm.models.llama import LayerSpec, LlamaForCausalLM

# transformers' Qwen2Config default when config.json omits max_window_layers.
_DEFAULT_MAX_WINDOW_LAYERS = 28


def qwen2_sliding_window(config: ModelConfig, layer_idx: int) -> int | None:
    """The window applies only with use_sliding_window, and then to the layers config.layer_types marks
    "sliding_attention" or, without layer_types, to layers at index >= max_window_layers."""
    if not config.use_sliding_window or config.sliding_window is None:
        return None
    if config.layer_types is not None:
        return config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
    first = config.max_window_layers if config.max_window_layers is not None else _DEFAULT_MAX_WINDOW_LAYERS
    return config.sliding_window if layer_idx >= first else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    def layer_spec(self, layer_idx: int) -> LayerSpec:
        return LayerSpec(qkv_bias=True, o_bias=False, sliding_window=qwen2_sliding_window(self.config, layer_idx))

    @classmethod
    def tiny_config(cls) -> dict[str, Any]:
        """Layer 0 full attention, layer 1 a window of 6: both halves of the Qwen2 rule."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": 311,
            "hidden_size": 64,
            "intermediate_size": 80,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "use_sliding_window": True,
            "sliding_window": 6,
            "max_window_layers": 1,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "dtype": "float32",
        }
