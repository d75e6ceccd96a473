"""Mistral: Llama with a sliding attention window on every layer (when config.json sets `sliding_window`)."""

from __future__ import annotations

from typing import Any

from tritonllm.models.llama import LayerSpec, LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    def layer_spec(self, layer_idx: int) -> LayerSpec:
        return LayerSpec(sliding_window=self.config.sliding_window)

    @classmethod
    def tiny_config(cls) -> dict[str, Any]:
        """Untied, plain RoPE, and a window (5) shorter than the test sequences so it actually slides."""
        return {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "vocab_size": 307,
            "hidden_size": 64,
            "intermediate_size": 112,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_window": 5,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "dtype": "float32",
        }
