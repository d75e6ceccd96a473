"""Qwen3 (dense): Qwen2's layout without the q/k/v bias, plus an RMSNorm on each q and k head before rotary."""

from __future__ import annotations

from typing import Any

import torch

from tritonllm.models.config import ModelConfig
from tritonllm.models.layers.layernorm import RMSNorm
from tritonllm.models.llama import LayerSpec, LlamaAttention, LlamaDecoderLayer
from tritonllm.models.qwen2 import Qwen2ForCausalLM, qwen2_sliding_window
from tritonllm.quant.base import QuantConfig


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, spec: LayerSpec, quant_config: QuantConfig | None, prefix: str):
        super().__init__(config, spec, quant_config, prefix)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q [T, Hq, D], k [T, Hk, D]: normalised over D, one weight shared by all heads.
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer

    def layer_spec(self, layer_idx: int) -> LayerSpec:
        # attention_bias (default false) covers q, k, v and o alike, as in Llama.
        bias = self.config.attention_bias
        return LayerSpec(qkv_bias=bias, o_bias=bias, sliding_window=qwen2_sliding_window(self.config, layer_idx))

    @classmethod
    def tiny_config(cls) -> dict[str, Any]:
        """head_dim 32 != hidden / heads, as in the real Qwen3 models; tied embeddings (Qwen3 0.6B style)."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": 293,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 256,
            "tie_word_embeddings": True,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "dtype": "float32",
        }
