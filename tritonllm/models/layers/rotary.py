"""Rotary embedding layer and the cos/sin cache math for the `rope_scaling` types config.json files carry."""

import math
from typing import Any

import torch
from torch import nn

from tritonllm.kernels.rope import apply_rotary, apply_rotary_and_cache

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Types whose scaling needs the pre-extension context length (HF fills it in from max_position_embeddings).
_NEEDS_ORIGINAL_MAX = ("llama3", "yarn", "longrope")


class RotaryEmbedding(nn.Module):
    """Holds the fp32 cos/sin cache [max_position, rotary_dim] and rotates q, k in place."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        cos_sin_cache: torch.Tensor,
        is_neox: bool = True,
        attention_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox = is_neox
        self.attention_factor = attention_factor  # already folded into the cache
        self.max_position = cos_sin_cache.shape[0]
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    def _apply(self, fn, recurse=True):
        # model.half()/.to(bf16) would round the cache; keep it fp32 and only follow device moves.
        cache = self.cos_sin_cache
        super()._apply(fn, recurse)
        self.cos_sin_cache = cache.to(device=self.cos_sin_cache.device)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq * D] or [T, Hq, D], k likewise; rotated in place and returned in their shapes."""
        q3 = q if q.dim() == 3 else q.view(q.shape[0], -1, self.head_size)
        k3 = k if k.dim() == 3 else k.view(k.shape[0], -1, self.head_size)
        apply_rotary(positions, q3, k3, self.cos_sin_cache, self.is_neox)
        return q, k

    def rotate_and_cache(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """q [T, Hq, D] rotated in place and returned; rotated k and v [T, Hk, D] written to their cache slots."""
        apply_rotary_and_cache(
            positions, q, k, v, self.cos_sin_cache, self.is_neox, k_cache, v_cache, slot_mapping
        )  # fmt: skip
        return q

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
            f"is_neox={self.is_neox}, attention_factor={self.attention_factor}"
        )


def _default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    # Same fp32 formula as HF and vLLM so caches agree bit for bit on the default path.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    return 1.0 / (base**exponents)


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any], factor: float) -> torch.Tensor:
    original_max = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dim index whose wavelength fits num_rotations times into the original context.
        return rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 - ramp  # 1: keep the original frequency (high freq), 0: interpolate by factor
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, device="cpu").float() / rotary_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = _default_inv_freq(rotary_dim, base)
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated smoothly.
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context / low_freq_factor, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= old_context / high_freq_factor) & (wavelen <= old_context / low_freq_factor)
    return torch.where(is_medium, smoothed, scaled)


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def compute_inv_freq(
    rotary_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float, int]:
    """(inv_freq [rotary_dim / 2] fp32, attention_factor, cache length) for one rope configuration."""
    rope_type = rope_type_of(rope_scaling)
    scaling = rope_scaling or {}
    if rope_type == "default":
        return _default_inv_freq(rotary_dim, base), 1.0, max_position
    if rope_type == "linear":
        factor = scaling["factor"]
        return _default_inv_freq(rotary_dim, base) / factor, 1.0, int(max_position * factor)
    if rope_type == "dynamic":
        # vLLM's fixed form of dynamic NTK: one cache at max_position * factor with the base that length implies.
        factor = scaling["factor"]
        cache_len = int(max_position * factor)
        ntk_base = base * ((factor * cache_len / max_position) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return _default_inv_freq(rotary_dim, ntk_base), 1.0, cache_len
    if rope_type == "llama3":
        return _llama3_inv_freq(rotary_dim, base, scaling), 1.0, max_position
    if rope_type == "yarn":
        original_max = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or max_position / original_max
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_get_mscale(factor)
        cache_len = max(int(original_max * factor), max_position)
        return _yarn_inv_freq(rotary_dim, base, scaling, factor), float(attention_factor), cache_len
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def build_cos_sin_cache(inv_freq: torch.Tensor, cache_len: int, attention_factor: float = 1.0) -> torch.Tensor:
    """[cache_len, 2 * len(inv_freq)] fp32: row p = [cos(p * inv_freq) | sin(p * inv_freq)] * attention_factor."""
    freqs = torch.outer(torch.arange(cache_len, dtype=torch.float32, device="cpu"), inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    is_neox: bool = True,
) -> RotaryEmbedding:
    """A RotaryEmbedding for a config's rope settings.

    max_position is config.max_position_embeddings. rope_scaling is the config's dict (key "rope_type" or the
    legacy "type"; a transformers-5 `rope_parameters` dict works too), or None for plain RoPE.
    The cache is built on the CPU; it follows the module's device moves and always stays fp32.
    """
    if rotary_dim % 2 != 0 or not 0 < rotary_dim <= head_size:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, head_size={head_size}]")
    inv_freq, attention_factor, cache_len = compute_inv_freq(rotary_dim, max_position, base, rope_scaling)
    cache = build_cos_sin_cache(inv_freq, cache_len, attention_factor)
    return RotaryEmbedding(head_size, rotary_dim, cache, is_neox=is_neox, attention_factor=attention_factor)


def rope_params_from_config(
    config: dict[str, Any], layer_type: str | None = None
) -> tuple[float, dict[str, Any] | None, float]:
    """(base, rope_scaling dict or None, partial_rotary_factor) from a config.json dict.

    Reads the legacy style (`rope_theta`, `rope_scaling` with "type"/"rope_type", `partial_rotary_factor`) and
    transformers 5's `rope_parameters` (holding rope_theta and rope_type, possibly nested per layer type such as
    {"full_attention": {...}, "sliding_attention": {...}}: pass layer_type to pick one).
    The returned scaling dict always has "rope_type" and, for llama3/yarn, "original_max_position_embeddings".
    """
    params = config.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        if layer_type not in params:
            raise ValueError(f"rope_parameters is nested per layer type {sorted(params)}; pass layer_type= one of them")
        params = params[layer_type] or {}
    scaling = dict(params or config.get("rope_scaling") or {})
    base = float(scaling.pop("rope_theta", None) or config.get("rope_theta") or 10000.0)
    partial = scaling.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0
    rope_type = rope_type_of(scaling)
    scaling.pop("type", None)
    if rope_type == "default":
        return base, None, float(partial)
    scaling["rope_type"] = rope_type
    if rope_type in _NEEDS_ORIGINAL_MAX:
        # As transformers does: a top-level original_max_position_embeddings (Phi-3 style) wins.
        if "original_max_position_embeddings" in config:
            scaling["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        elif "max_position_embeddings" in config:
            scaling.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return base, scaling, float(partial)
