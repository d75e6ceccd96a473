"""Format detection from config.json and legacy files, the explicit `quantization` argument, refusals that name the
field and the supported values, and which layers stay unquantized."""

import json

import pytest

from tritonllm.models.layers.linear import UnquantizedLinearMethod
from tritonllm.quant import get_quant_config
from tritonllm.quant.awq import AwqConfig, AwqLinearMethod
from tritonllm.quant.gptq import GptqConfig, GptqLinearMethod

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False, "static_groups": False}


def with_qc(qc):
    return {"architectures": ["LlamaForCausalLM"], "quantization_config": qc}


def test_dense_checkpoint_has_no_quant_config(tmp_path):
    assert get_quant_config({"architectures": ["LlamaForCausalLM"]}, str(tmp_path)) is None
    assert get_quant_config({}, None) is None


def test_awq_from_config_json():
    cfg = get_quant_config(with_qc({**AWQ, "modules_to_not_convert": ["visual"]}), None)
    assert isinstance(cfg, AwqConfig) and cfg.name == "awq"
    assert (cfg.bits, cfg.group_size, cfg.modules_to_not_convert) == (4, 128, ["visual"])


def test_awq_version_is_case_insensitive_and_legacy_keys_are_read(tmp_path):
    # AutoAWQ's own quant_config.json: w_bit, q_group_size, version "GEMM", no quant_method.
    (tmp_path / "quant_config.json").write_text(
        json.dumps({"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"})
    )
    cfg = get_quant_config({"architectures": ["LlamaForCausalLM"]}, str(tmp_path))
    assert isinstance(cfg, AwqConfig) and cfg.group_size == 64


def test_gptq_from_config_json():
    cfg = get_quant_config(with_qc({**GPTQ, "checkpoint_format": "gptq_v2"}), None, quantization="gptq")
    assert isinstance(cfg, GptqConfig) and cfg.name == "gptq"
    assert (cfg.bits, cfg.group_size, cfg.desc_act, cfg.sym, cfg.checkpoint_format) == (4, 128, True, False, "gptq_v2")
    assert cfg.zero_offset == 0
    assert get_quant_config(with_qc(GPTQ), None).zero_offset == 1  # checkpoint_format defaults to v1 "gptq"


def test_gptq_legacy_quantize_config_json_without_quant_method(tmp_path):
    legacy = {
        "bits": 8,
        "group_size": -1,
        "damp_percent": 0.01,
        "desc_act": False,
        "sym": True,
        "true_sequential": True,
    }
    (tmp_path / "quantize_config.json").write_text(json.dumps(legacy))
    cfg = get_quant_config({"architectures": ["LlamaForCausalLM"]}, str(tmp_path), quantization="GPTQ")
    assert isinstance(cfg, GptqConfig) and (cfg.bits, cfg.group_size) == (8, -1)


def test_config_json_wins_over_legacy_file(tmp_path):
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 8, "group_size": 32}))
    assert isinstance(get_quant_config(with_qc(AWQ), str(tmp_path)), AwqConfig)


@pytest.mark.parametrize(
    ("config", "quantization", "message"),
    [
        (with_qc(AWQ), "gptq", r"quantization='gptq' was requested but .* declares 'awq'"),
        (with_qc(GPTQ), "awq", r"quantization='awq' was requested but .* declares 'gptq'"),
        ({"architectures": ["X"]}, "awq", "declares no quantization"),
        (with_qc(AWQ), "fp8", r"quantization='fp8' is not supported; supported: 'awq', 'gptq'"),
    ],
)
def test_explicit_quantization_must_agree(config, quantization, message):
    with pytest.raises(ValueError, match=message):
        get_quant_config(config, None, quantization)


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        ({**AWQ, "bits": 3}, r"quantization_config\.bits=3 is not supported for AWQ; supported: 4"),
        (
            {**AWQ, "version": "gemv"},
            r"quantization_config\.version='gemv' is not supported for AWQ; supported: 'gemm'",
        ),
        ({**AWQ, "version": "marlin"}, r"version='marlin' .* supported: 'gemm'"),
        ({**AWQ, "zero_point": False}, r"zero_point=false is not supported for AWQ; supported: true"),
        ({**AWQ, "group_size": 0}, r"group_size=0 is not supported; supported: -1"),
        ({**GPTQ, "bits": 5}, r"bits=5 is not supported for GPTQ; supported: 2, 3, 4, 8"),
        (
            {**GPTQ, "checkpoint_format": "marlin"},
            r"checkpoint_format='marlin' is not supported; supported: 'gptq', 'gptq_v2'",
        ),
        ({**GPTQ, "is_marlin_format": True}, r"is_marlin_format=true .* supported: false"),
        ({**GPTQ, "pack_dtype": "int16"}, r"pack_dtype='int16' is not supported; supported: 'int32'"),
        ({**GPTQ, "lm_head": True}, r"lm_head=true .* supported: false"),
        ({**GPTQ, "dynamic": {r"-:.*down": {}}}, r"dynamic .* not supported"),
        ({**GPTQ, "group_size": -7}, r"group_size=-7 is not supported"),
        ({**GPTQ, "bits": "4"}, r"bits='4' must be an integer"),
        (
            {**GPTQ, "quant_method": "bitsandbytes"},
            r"quant_method='bitsandbytes' is not supported; supported: 'awq', 'gptq'",
        ),
        ({"foo": 1}, r"no 'quant_method'"),
    ],
)
def test_unsupported_settings_are_refused_at_load_time(qc, message):
    with pytest.raises(ValueError, match=message):
        get_quant_config(with_qc(qc), None)


@pytest.mark.parametrize("settings", [AWQ, GPTQ])
def test_skipped_modules_and_lm_head_stay_unquantized(settings):
    cfg = get_quant_config(
        with_qc({**settings, "modules_to_not_convert": ["mlp.down_proj", "layers.1.self_attn"]}), None
    )
    quantized = AwqLinearMethod if settings is AWQ else GptqLinearMethod
    assert isinstance(cfg.get_linear_method("model.layers.0.self_attn.qkv_proj"), quantized)
    assert isinstance(cfg.get_linear_method("model.layers.0.mlp.gate_up_proj"), quantized)
    assert isinstance(cfg.get_linear_method("model.layers.0.mlp.down_proj"), UnquantizedLinearMethod)
    # Fused layers match through their checkpoint names (layers.1.self_attn.q_proj, ...).
    assert isinstance(cfg.get_linear_method("model.layers.1.self_attn.qkv_proj"), UnquantizedLinearMethod)
    assert isinstance(cfg.get_linear_method("model.layers.1.self_attn.o_proj"), UnquantizedLinearMethod)
    assert isinstance(cfg.get_linear_method("lm_head"), UnquantizedLinearMethod)


def test_partly_skipped_fused_layer_is_refused():
    cfg = get_quant_config(with_qc({**AWQ, "modules_to_not_convert": ["self_attn.k_proj"]}), None)
    with pytest.raises(ValueError, match="leaves only some of them unquantized"):
        cfg.get_linear_method("model.layers.0.self_attn.qkv_proj")
