"""Quantized checkpoints in the tools' layout (config.json or a legacy settings file, per-projection tensor names)
load through the real loader and give, through prefill and decode on a paged KV cache, the logits of the same
transformers model holding the dequantized float weights."""

import pytest
import torch
from hypothesis import Phase, given, settings

from tests.helpers import DEVICE, seeds
from tests.models.checkpoints import hf_logits, tiny_config
from tests.models.paged_runner import PagedRunner
from tests.quant.checkpoints import awq_settings, gptq_settings, write_quantized_checkpoint
from tritonllm.models.loader import load_model

# fp32 end to end: the quantized weights dequantize exactly, so only summation order differs.
FP32_TOL = dict(atol=2e-5, rtol=1e-4)

CASES = [
    # id, arch, config overrides, settings, legacy settings file, projections left dense, explicit quantization
    ("llama-awq-g32", "LlamaForCausalLM", {}, awq_settings(32), None, (), "awq"),
    (
        "qwen2-gptq4-actorder-v1",
        "Qwen2ForCausalLM",
        {"intermediate_size": 96},
        gptq_settings(4, 32, sym=False, desc_act=True, checkpoint_format="gptq"),
        None,
        (),
        None,
    ),
    (
        "llama-gptq3-actorder-v2-legacy-file",
        "LlamaForCausalLM",
        {},
        gptq_settings(3, 32, sym=True, desc_act=True, checkpoint_format="gptq_v2"),
        "quantize_config.json",
        (),
        "gptq",
    ),
    (
        "qwen2-gptq8-one-group-skip-down",
        "Qwen2ForCausalLM",
        {"intermediate_size": 96},
        gptq_settings(8, -1, sym=False, desc_act=False, checkpoint_format="gptq"),
        None,
        ("down_proj",),
        None,
    ),
]


@pytest.mark.parametrize(
    ("arch", "overrides", "quant", "legacy_file", "skip", "quantization"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
# One example each; no shrinking (a seed is an opaque integer, and every run builds and loads a model).
@settings(max_examples=1, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(seed=seeds())
def test_quantized_checkpoint_matches_dequantized_model(
    arch, overrides, quant, legacy_file, skip, quantization, seed, tmp_path_factory
):
    config = tiny_config(arch, **overrides)
    path = tmp_path_factory.mktemp("quantized")
    reference = write_quantized_checkpoint(config, quant, path, seed, legacy_file=legacy_file, skip=skip)
    model, _ = load_model(str(path), device=DEVICE, quantization=quantization)

    methods = {type(m.linear_method).__name__ for m in model.modules() if hasattr(m, "linear_method")}
    expected_methods = {"AwqLinearMethod" if quant["quant_method"] == "awq" else "GptqLinearMethod"}
    if skip:
        expected_methods.add("UnquantizedLinearMethod")
    assert methods == expected_methods

    g = torch.Generator().manual_seed(seed)
    prompt_len, num_decode = 6, 1
    tokens = torch.randint(0, config["vocab_size"], (prompt_len + num_decode,), generator=g).tolist()
    runner = PagedRunner(model, seed=seed)
    logits = runner.step([(0, tokens[:prompt_len])])
    for t in tokens[prompt_len:]:
        logits += runner.step([(0, [t])])
    ours = torch.cat(logits).cpu()
    torch.testing.assert_close(ours, hf_logits(reference, tokens), **FP32_TOL)
