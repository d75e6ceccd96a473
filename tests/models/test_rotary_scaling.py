"""Rotary scaling math against transformers' ROPE_INIT_FUNCTIONS (an independent implementation)."""

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tests.helpers import DEVICE, assert_close
from tritonllm.kernels.rope import apply_rotary_ref
from tritonllm.models.layers.rotary import compute_inv_freq, get_rope, rope_params_from_config

# Real-looking config.json fragments (legacy `rope_scaling` style unless noted).
CONFIGS = {
    "llama3.1": dict(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
    ),
    "qwen-yarn": dict(
        hidden_size=5120,
        num_attention_heads=40,
        head_dim=128,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32768),
    ),
    "deepseek-yarn-mscale": dict(
        hidden_size=1024,
        num_attention_heads=16,
        head_dim=64,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling=dict(
            type="yarn",
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=1.0,
        ),
    ),
    "gpt-oss-yarn-v5": dict(  # transformers 5 style: everything inside rope_parameters
        hidden_size=2880,
        num_attention_heads=64,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
    ),
    "yarn-attention-factor": dict(
        hidden_size=512,
        num_attention_heads=8,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=4096, attention_factor=0.9),
    ),
    "linear": dict(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_scaling=dict(type="linear", factor=2.0),
    ),
    "linear-partial-v5": dict(
        hidden_size=2048,
        num_attention_heads=32,
        max_position_embeddings=2048,
        rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=25000.0, partial_rotary_factor=0.5),
    ),
    "dynamic": dict(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_scaling=dict(type="dynamic", factor=2.0),
    ),
    "default": dict(hidden_size=2048, num_attention_heads=16, max_position_embeddings=2048, rope_theta=1000000.0),
}


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _hf_inv_freq(cfg: dict) -> tuple[torch.Tensor, float]:
    hf_config = LlamaConfig.from_dict(dict(cfg))
    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    seq_len = None
    if rope_type == "dynamic":  # the length our fixed dynamic cache is built for
        seq_len = int(cfg["max_position_embeddings"] * hf_config.rope_parameters["factor"])
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=seq_len)


def _ours(cfg: dict) -> tuple[torch.Tensor, float, int, int]:
    base, scaling, partial = rope_params_from_config(cfg)
    rotary_dim = int(_head_dim(cfg) * partial)
    inv_freq, attention_factor, cache_len = compute_inv_freq(rotary_dim, cfg["max_position_embeddings"], base, scaling)
    return inv_freq, attention_factor, cache_len, rotary_dim


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_inv_freq_and_attention_factor_match_transformers(name):
    cfg = CONFIGS[name]
    expected_inv_freq, expected_factor = _hf_inv_freq(cfg)
    inv_freq, attention_factor, _, rotary_dim = _ours(cfg)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (rotary_dim // 2,)
    torch.testing.assert_close(inv_freq, expected_inv_freq.float(), rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(expected_factor, rel=1e-9)


def test_scaling_types_actually_change_the_frequencies():
    # Guards against a parser that silently drops rope_scaling: every scaled config differs from plain RoPE.
    for name, cfg in CONFIGS.items():
        if name == "default":
            continue
        plain = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters")}
        assert not torch.allclose(_ours(cfg)[0], _ours(plain)[0][: _ours(cfg)[0].shape[0]]), name


@pytest.mark.parametrize(
    ("name", "expected_len"),
    [
        ("llama3.1", 131072),
        ("qwen-yarn", 131072),
        ("linear", 8192),
        ("dynamic", 8192),
        ("default", 2048),
        ("linear-partial-v5", 8192),
    ],
)
def test_cache_length(name, expected_len):
    assert _ours(CONFIGS[name])[2] == expected_len


@pytest.mark.parametrize("scaling", [None, dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)])
def test_get_rope_cache_rows(scaling):
    # Row p = [cos(p f) | sin(p f)] * attention_factor, with f and the factor from transformers.
    head_size, rotary_dim, max_position, base = 48, 32, 256, 10000.0
    rope = get_rope(head_size, rotary_dim, max_position, base, scaling, is_neox=True)
    cfg = dict(hidden_size=head_size * 2, num_attention_heads=2, max_position_embeddings=max_position, rope_theta=base)
    if scaling:
        cfg["rope_scaling"] = dict(scaling)
    cfg["partial_rotary_factor"] = rotary_dim / head_size
    inv_freq, factor = (
        ROPE_INIT_FUNCTIONS["yarn"](LlamaConfig.from_dict(cfg), "cpu")
        if scaling
        else (1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim), 1.0)
    )
    cache = rope.cos_sin_cache
    assert cache.dtype == torch.float32 and cache.shape == (max_position, rotary_dim)
    positions = torch.tensor([0, 1, 17, 100, max_position - 1])
    angles = positions[:, None].double() * inv_freq.double()[None, :]
    expected = torch.cat([angles.cos(), angles.sin()], dim=-1) * factor
    torch.testing.assert_close(cache[positions].double(), expected, atol=2e-5, rtol=0)


def test_rotary_module_keeps_fp32_cache_and_accepts_flat_heads():
    rope = get_rope(32, 32, 64, 10000.0, None, is_neox=False)
    rope = rope.to(torch.bfloat16).to(DEVICE)
    assert rope.cos_sin_cache.dtype == torch.float32
    positions = torch.tensor([3, 0, 63], device=DEVICE)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, (4 + 2) * 32, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
    q, k = qkv[:, : 4 * 32], qkv[:, 4 * 32 : 5 * 32]  # flat [T, H * D] slices, as a split qkv gives them
    expected_q, expected_k = apply_rotary_ref(
        positions, q.reshape(3, 4, 32), k.reshape(3, 1, 32), rope.cos_sin_cache, False
    )
    out_q, out_k = rope(positions, q, k)
    assert out_q.shape == (3, 128) and out_k.shape == (3, 32)
    assert_close(q.view(3, 4, 32), expected_q)
    assert_close(k.view(3, 1, 32), expected_k)


def test_rope_params_legacy_and_v5_styles_agree():
    legacy = dict(
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(
            type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
    )
    v5 = dict(
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    assert rope_params_from_config(legacy) == rope_params_from_config(v5)
    base, scaling, partial = rope_params_from_config(v5)
    assert base == 500000.0 and partial == 1.0
    assert scaling["rope_type"] == "llama3" and "rope_theta" not in scaling and "type" not in scaling


def test_rope_params_defaults_and_fills():
    assert rope_params_from_config({}) == (10000.0, None, 1.0)
    assert rope_params_from_config(dict(rope_theta=1e6, partial_rotary_factor=0.25)) == (1e6, None, 0.25)
    assert rope_params_from_config(dict(rope_parameters=dict(rope_type="default", rope_theta=5e5))) == (5e5, None, 1.0)
    # yarn without original_max_position_embeddings falls back to max_position_embeddings, as transformers does
    _, scaling, _ = rope_params_from_config(
        dict(max_position_embeddings=4096, rope_scaling=dict(type="yarn", factor=2.0))
    )
    assert scaling["original_max_position_embeddings"] == 4096
    nested = dict(
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
            sliding_attention=dict(rope_type="default", rope_theta=1e4),
        )
    )
    assert rope_params_from_config(nested, layer_type="sliding_attention") == (1e4, None, 1.0)
    assert rope_params_from_config(nested, layer_type="full_attention")[1] == dict(rope_type="linear", factor=8.0)
    with pytest.raises(ValueError, match="sliding_attention"):
        rope_params_from_config(nested)


def test_unknown_rope_type_names_type_and_supported():
    with pytest.raises(ValueError, match=r"'su'.*llama3.*yarn"):
        get_rope(64, 64, 128, 10000.0, dict(type="su", factor=2.0))


def test_yarn_attention_factor_default_formula():
    _, factor, _ = compute_inv_freq(
        64, 4096, 10000.0, dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)
    )
    assert factor == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_rotary_cache_survives_meta_construction_and_to_empty():
    # Loaders may build models under torch.device("meta") then to_empty(): the cache must stay real values.
    scaling = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    reference = get_rope(64, 64, 256, 10000.0, scaling).cos_sin_cache
    with torch.device("meta"):
        rope = get_rope(64, 64, 256, 10000.0, scaling)
    rope.to_empty(device=DEVICE)
    assert rope.cos_sin_cache.device.type == DEVICE.type
    torch.testing.assert_close(rope.cos_sin_cache.cpu(), reference, atol=0, rtol=0)
