"""load_format="dummy" on quantized configs: packed words, scales and g_idx that run like a real checkpoint's."""

from __future__ import annotations

import json
import os
from functools import cache

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import DEVICE, seeds
from tests.models.checkpoints import tiny_config
from tritonllm.kernels.quant_dequant import awq_dequantize_ref, gptq_dequantize_ref
from tritonllm.models.layers.linear import Linear
from tritonllm.models.loader import init_dummy_weights, load_model
from tritonllm.quant.config import get_quant_config
from tritonllm.quant.pack import regular_g_idx, unpack_bits
from tritonllm.runtime.forward_context import set_forward_context

GROUP = 32
FORMATS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "gptq4": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True},
    "gptq8": {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "desc_act": True, "sym": False},
    "gptq3": {"quant_method": "gptq", "bits": 3, "group_size": GROUP},
    "gptq4v2": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "checkpoint_format": "gptq_v2"},
}


@cache
def _model(fmt: str, tmp_root: str):
    path = f"{tmp_root}/{fmt}"
    os.makedirs(path, exist_ok=True)
    config = tiny_config("LlamaForCausalLM", quantization_config=FORMATS[fmt])
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    model, _ = load_model(path, dtype="float16", load_format="dummy", device=DEVICE)
    return path, model


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("dummy-quant"))


def _quantized_layers(model):
    return [m for m in model.modules() if hasattr(m, "qweight")]


def _awq_repacked(layer) -> bool:
    """A loaded AWQ layer holds GPTQ's layout (repacked in process_weights_after_loading, zero offset 0)."""
    return getattr(layer, "awq_layout", None) == "gptq"


def _dequantized(layer, fmt: str) -> torch.Tensor:
    bits = FORMATS[fmt]["bits"]
    if fmt == "awq":
        if _awq_repacked(layer):
            return gptq_dequantize_ref(layer.qweight, layer.qzeros, layer.scales, None, 4, GROUP, 0)
        return awq_dequantize_ref(layer.qweight, layer.qzeros, layer.scales, GROUP)
    offset = 0 if FORMATS[fmt].get("checkpoint_format") == "gptq_v2" else 1
    return gptq_dequantize_ref(layer.qweight, layer.qzeros, layer.scales, layer.g_idx[0], bits, GROUP, offset)


@pytest.mark.parametrize("fmt", list(FORMATS))
@given(seed=seeds(), layer_index=st.integers(0, 3))
def test_dummy_quantized_weights_are_sane(tmp_root, fmt, seed, layer_index):
    _, model = _model(fmt, tmp_root)
    init_dummy_weights(model, seed=seed)
    layers = _quantized_layers(model)
    assert len(layers) == 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down per layer
    layer = layers[layer_index % len(layers)]
    bits = FORMATS[fmt]["bits"]

    assert (layer.scales > 0).all() and torch.isfinite(layer.scales).all()
    if fmt.startswith("gptq"):
        k = layer.g_idx.shape[1]
        # Layers keep their regular groups (a random g_idx would index groups that do not exist).
        assert torch.equal(layer.g_idx.cpu(), regular_g_idx(k, GROUP).expand_as(layer.g_idx))
    if bits in (4, 8):
        # Every packed field is uniform over its range: the top bits of the words are used too.
        fields = unpack_bits(layer.qweight, bits, dim=0 if fmt.startswith("gptq") or _awq_repacked(layer) else 1)
        assert fields.min() == 0 and fields.max() == 2**bits - 1
        assert (layer.qweight < 0).any()
    w = _dequantized(layer, fmt).float()
    assert torch.isfinite(w).all()
    assert 0.01 < w.std().item() < 0.04  # like the dense dummy weights' 0.02, whatever the bit width


@pytest.mark.parametrize("fmt", list(FORMATS))
@given(seed=seeds())
def test_dummy_quantized_weights_are_centred(fmt, seed):
    # Dense dummy weights have mean 0. A bias b per weight adds K * b * mean(x) to every output feature alike, and
    # through the residual stream that grows layer by layer (fp16 overflow within a few Llama-8B-sized layers).
    # GPTQ v1 reads zero = stored field + 1, so uniform fields alone would give every weight the mean -s.
    quant_config = get_quant_config({"quantization_config": FORMATS[fmt]}, None)
    with torch.device(DEVICE):
        layer = Linear(1024, [256, 256], quant_config=quant_config, params_dtype=torch.float16)
    init_dummy_weights(layer, seed=seed)
    w = _dequantized(layer, fmt).float()
    # 32 groups x 512 columns of zeros: the sample mean's own spread is under 0.01 of the std.
    assert abs(w.mean().item()) < 0.04 * w.std().item()
    assert 0.01 < w.std().item() < 0.04


@pytest.mark.parametrize("fmt", ["awq", "gptq4"])
def test_dummy_quantized_model_runs_and_is_reproducible(tmp_root, fmt):
    # Two loads give the same parameters. (Not a re-initialization of a loaded model: loading also repacks AWQ
    # words, so the dummy words drawn in AWQ's layout end up elsewhere.)
    path, _ = _model(fmt, tmp_root)
    first, _ = load_model(path, dtype="float16", load_format="dummy", device=DEVICE)
    again, _ = load_model(path, dtype="float16", load_format="dummy", device=DEVICE)
    for (name, a), b in zip(first.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b), name
    for layer in _quantized_layers(again):
        assert getattr(layer, "gptq_mode", "fused") == "fused"
    ids = torch.arange(5, device=DEVICE) * 7
    with torch.no_grad(), set_forward_context(None):
        logits = again.compute_logits(again(ids, torch.arange(5, device=DEVICE)))
    assert torch.isfinite(logits).all() and logits.std() > 0
