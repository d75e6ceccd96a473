"""Llama 2 / 3 / 3.1 / 3.2 (and the base other decoder-only architectures subclass).

Module names mirror Hugging Face's (model.layers.N.self_attn.qkv_proj, ...) so checkpoint names map by their last
path components; q/k/v and gate/up are fused (see `packed_modules_mapping`).

Tensor parallelism (a tp group of W ranks): qkv_proj and gate_up_proj are column-parallel, o_proj and down_proj
row-parallel, embedding and head vocabulary-parallel. A rank runs num_heads / W query heads and its share of the
KV heads end to end, so each block communicates once after attention and once after the MLP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tritonllm.models.config import ModelConfig
from tritonllm.models.layers.activation import get_act_and_mul
from tritonllm.models.layers.attention import Attention
from tritonllm.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tritonllm.models.layers.layernorm import RMSNorm
from tritonllm.models.layers.parallel_linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tritonllm.models.layers.rotary import get_rope
from tritonllm.quant.base import QuantConfig


@dataclass(slots=True)
class LayerSpec:
    """Per-layer choices an architecture makes from its config."""

    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None  # attend to at most this many most recent tokens (self included)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            hidden, [inter, inter], config.mlp_bias, quant_config, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(inter, hidden, config.mlp_bias, quant_config, f"{prefix}.down_proj")
        self.act_fn = get_act_and_mul(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj.forward_gated(x, self.act_fn.kind)  # one launch at decode rows, where it runs
        if h is None:
            h = self.act_fn(self.gate_up_proj(x))
        return self.down_proj(h)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec, quant_config: QuantConfig | None, prefix: str):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            spec.qkv_bias,
            quant_config,
            f"{prefix}.qkv_proj",
        )
        # This rank's heads (all of them with one rank).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            spec.o_bias,
            quant_config,
            f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            config.rotary_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            is_neox=True,
        )
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, sliding_window=spec.sliding_window
        )

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook between projection and rotary (identity here; Qwen3 normalises each head)."""
        return q, k

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.norm_qk(q, k)
        out = self.attn(q, k, v, positions, self.rotary_emb)  # [T, num_heads, head_dim]; rotary fused with the KV write
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    mlp_cls: type[LlamaMLP] = LlamaMLP

    def __init__(self, config: ModelConfig, spec: LayerSpec, quant_config: QuantConfig | None, prefix: str):
        super().__init__()
        self.self_attn = self.attention_cls(config, spec, quant_config, f"{prefix}.self_attn")
        self.mlp = self.mlp_cls(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse the preceding residual add.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        quant_config: QuantConfig | None,
        decoder_layer_cls: type[LlamaDecoderLayer],
        layer_spec: Callable[[int], LayerSpec],
        prefix: str = "model",
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            decoder_layer_cls(config, layer_spec(i), quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, H]; compute_logits(hidden [N, H]) -> [N, vocab] fp32.

    Subclasses change the architecture through `decoder_layer_cls` and `layer_spec`, not by copying.
    """

    packed_modules_mapping: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None):
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.model = LlamaModel(config, quant_config, self.decoder_layer_cls, self.layer_spec, prefix="model")
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    def layer_spec(self, layer_idx: int) -> LayerSpec:
        """Llama: attention_bias puts a bias on q, k, v and o; no sliding window."""
        return LayerSpec(qkv_bias=self.config.qkv_bias, o_bias=self.config.attention_bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        """The Attention layers in execution order, for the runner to bind per-layer KV cache views."""
        return [layer.self_attn.attn for layer in self.model.layers]

    @classmethod
    def tiny_config(cls) -> dict[str, Any]:
        """Llama 3.2 style: tied embeddings, llama3 rope scaling, GQA."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 301,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 256,
            "tie_word_embeddings": True,
            "hidden_act": "silu",
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,  # wavelengths fall in all three llama3 bands
            },
            "bos_token_id": 1,
            "eos_token_id": [2, 3],
            "dtype": "float32",
        }
