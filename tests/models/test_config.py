"""ModelConfig parsing agrees with transformers on the fields and per-layer sliding windows the models use."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.models.checkpoints import builtin_architectures, tiny_config
from tritonllm.models.config import ModelConfig
from tritonllm.models.registry import get_model_class

ARCHS = builtin_architectures()


@st.composite
def config_dicts(draw):
    """A tiny config of a random architecture with shape, tying, rope and sliding options redrawn."""
    arch = draw(st.sampled_from(ARCHS))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    layers = draw(st.integers(1, 4))
    d = tiny_config(
        arch,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_size=16 * heads,
        tie_word_embeddings=draw(st.booleans()),
        rope_parameters={"rope_type": "default", "rope_theta": draw(st.sampled_from([1e4, 5e5, 1e6]))},
    )
    if draw(st.booleans()):
        d.pop("head_dim", None)  # then head_dim = hidden / heads
    else:
        d["head_dim"] = draw(st.sampled_from([8, 16, 32]))
    if arch != "LlamaForCausalLM":
        d["sliding_window"] = draw(st.one_of(st.none(), st.integers(2, 9)))
        d["use_sliding_window"] = draw(st.booleans())
        d["max_window_layers"] = draw(st.integers(0, layers))
        if draw(st.booleans()):
            d["layer_types"] = draw(
                st.lists(st.sampled_from(["full_attention", "sliding_attention"]), min_size=layers, max_size=layers)
            )
    return arch, d


@given(config_dicts())
def test_fields_and_sliding_windows_match_transformers(case):
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, d = case
    hf_config = AutoConfig.for_model(**d)
    # What we parse is the config.json transformers itself writes (and, for the windows, the dict as drawn).
    cfg = ModelConfig.from_dict(json.loads(hf_config.to_json_string()))
    assert cfg.architectures == [arch]
    assert cfg.num_attention_heads == hf_config.num_attention_heads
    assert cfg.num_key_value_heads == hf_config.num_key_value_heads
    hf_head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    assert cfg.head_dim == hf_head_dim
    assert cfg.tie_word_embeddings == hf_config.tie_word_embeddings
    assert cfg.rope_theta == hf_config.rope_parameters["rope_theta"]
    assert cfg.rms_norm_eps == hf_config.rms_norm_eps
    assert cfg.vocab_size == hf_config.vocab_size and cfg.intermediate_size == hf_config.intermediate_size

    # Per-layer windows: ours from the model class, transformers' from its modules (Mistral's live on the config).
    hf = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    default = getattr(hf_config, "sliding_window", None)
    theirs = [getattr(layer.self_attn, "sliding_window", default) for layer in hf.model.layers]
    for parsed in (cfg, ModelConfig.from_dict(d)):
        assert [layer.sliding_window for layer in get_model_class(arch)(parsed).attention_layers()] == theirs


def test_defaults_from_a_minimal_config():
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 11,
            "hidden_size": 96,
            "intermediate_size": 5,
            "num_hidden_layers": 1,
            "num_attention_heads": 6,
        }
    )
    assert cfg.num_key_value_heads == 6 and cfg.head_dim == 16 and cfg.rotary_dim == 16
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert not cfg.tie_word_embeddings and cfg.hidden_act == "silu"
    assert cfg.torch_dtype is None and cfg.quantization_config is None
    assert cfg.eos_token_ids == [] and cfg.sliding_window is None


def test_legacy_fields_and_extras():
    d = {
        **tiny_config("LlamaForCausalLM"),
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "partial_rotary_factor": 0.5,
        "torch_dtype": "bfloat16",
        "eos_token_id": 7,
        "bos_token_id": [1, 5],
        "attention_bias": True,
        "quantization_config": {"quant_method": "awq", "bits": 4},
        "custom_field": [1, 2, 3],
    }
    del d["rope_parameters"], d["dtype"]
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["rope_type"] == "linear" and cfg.rope_scaling["factor"] == 2.0
    assert cfg.rotary_dim == 8
    assert cfg.torch_dtype == "bfloat16"
    assert cfg.eos_token_ids == [7] and cfg.bos_token_ids == [1, 5]
    assert cfg.attention_bias and cfg.qkv_bias
    assert cfg.quantization_config == {"quant_method": "awq", "bits": 4}
    assert cfg.raw["custom_field"] == [1, 2, 3]


def test_missing_fields_are_named_with_the_file(tmp_path):
    d = tiny_config("Qwen2ForCausalLM")
    del d["hidden_size"], d["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="config.json") as e:
        ModelConfig.from_file(tmp_path)
    assert str(tmp_path) in str(e.value) and "'hidden_size'" in str(e.value) and "'vocab_size'" in str(e.value)


def test_bad_files_and_shapes(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads"):
        ModelConfig.from_dict({**tiny_config("LlamaForCausalLM"), "num_key_value_heads": 3})
    bad = tiny_config("LlamaForCausalLM", hidden_size=65)
    del bad["head_dim"]
    with pytest.raises(ValueError, match="head_dim"):
        ModelConfig.from_dict(bad)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"])
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"use_sliding_window": False, "max_window_layers": 0}, [None, None, None]),
        ({"use_sliding_window": True, "max_window_layers": 1}, [None, 4, 4]),
        ({"use_sliding_window": True, "max_window_layers": 3}, [None, None, None]),
        (
            {"use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
            [4, None, 4],
        ),
        ({"use_sliding_window": True, "max_window_layers": 0, "sliding_window": None}, [None, None, None]),
    ],
)
def test_qwen2_window_rule(arch, extra, expected):
    """Qwen2/Qwen3 follow use_sliding_window, max_window_layers and layer_types; Mistral slides every layer.

    Parsed both from the dict as written (older files carry no layer_types) and from transformers' re-save."""
    from transformers import AutoConfig

    d = tiny_config(arch, **{"num_hidden_layers": 3, "sliding_window": 4, **extra})
    if arch == "MistralForCausalLM":
        expected = [d["sliding_window"]] * 3
    resaved = json.loads(AutoConfig.for_model(**d).to_json_string())
    for source in (d, resaved):
        cfg = ModelConfig.from_dict(source)
        assert [layer.sliding_window for layer in get_model_class(arch)(cfg).attention_layers()] == expected
