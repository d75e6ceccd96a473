"""ModelConfig: the fields of a Hugging Face config.json that the native models need, parsed without transformers."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from tritonllm.models.layers.rotary import rope_params_from_config

_REQUIRED = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(slots=True)
class ModelConfig:
    """One decoder-only model's shape and options.

    Architecture-specific policy (which layers slide, whether q/k/v carry a bias) is decided by the model class
    from these fields; anything a model needs beyond them stays reachable through `raw`.
    """

    architectures: list[str]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # rope_type + its parameters; None for plain RoPE
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False  # Llama semantics: bias on q, k, v and o
    qkv_bias: bool = False  # bias on q, k, v only; follows attention_bias unless the file says otherwise
    mlp_bias: bool = False
    sliding_window: int | None = None
    use_sliding_window: bool = False  # Qwen2/Qwen3: the window applies only when this is true ...
    max_window_layers: int | None = None  # ... and only to layers >= this index
    layer_types: list[str] | None = None  # explicit per-layer "full_attention" / "sliding_attention"
    torch_dtype: str | None = None  # the checkpoint's dtype name ("bfloat16", ...), from `dtype` or `torch_dtype`
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    model_type: str | None = None
    quantization_config: dict[str, Any] | None = None  # raw; interpreted by tritonllm.quant
    raw: dict[str, Any] = field(default_factory=dict)
    source: str = "config.json"  # where it was read from, for error messages

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> list[int]:
        return _as_id_list(self.eos_token_id)

    @property
    def bos_token_ids(self) -> list[int]:
        return _as_id_list(self.bos_token_id)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            names = ", ".join(repr(k) for k in missing)
            raise ValueError(f"{source} is missing required field(s) {names}; is it a decoder-only LLM config?")
        archs = d["architectures"]
        if isinstance(archs, str):
            archs = [archs]
        if not archs:
            raise ValueError(f"{source} has an empty 'architectures' list; it must name the model class")

        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(
                    f"{source}: hidden_size {hidden} is not divisible by num_attention_heads {heads} "
                    "and no 'head_dim' is given; add head_dim to the config"
                )
            head_dim = hidden // heads
        if heads % kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )

        rope_theta, rope_scaling, partial = rope_params_from_config(d)
        attention_bias = bool(d.get("attention_bias", False))
        dtype = d.get("dtype") or d.get("torch_dtype")
        return cls(
            architectures=list(archs),
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            partial_rotary_factor=float(partial),
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            hidden_act=str(d.get("hidden_act") or d.get("hidden_activation") or "silu"),
            attention_bias=attention_bias,
            qkv_bias=bool(d.get("qkv_bias", attention_bias)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=_opt_int(d.get("sliding_window")),
            use_sliding_window=bool(d.get("use_sliding_window", False)),
            max_window_layers=_opt_int(d.get("max_window_layers")),
            layer_types=list(d["layer_types"]) if d.get("layer_types") is not None else None,
            torch_dtype=str(dtype).removeprefix("torch.") if dtype is not None else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            model_type=d.get("model_type"),
            quantization_config=d.get("quantization_config"),
            raw=dict(d),
            source=source,
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ModelConfig:
        """Read `path`, a config.json file or a model directory that holds one."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}; point at a Hugging Face model directory")
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(d, source=path)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _as_id_list(v: int | list[int] | None) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, list | tuple) else [int(v)]
