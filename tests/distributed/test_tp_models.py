"""Whole models at tensor_parallel_size 2 (CPU, gloo, interpreter) give the logits of the same checkpoint at 1.

Each case writes a tiny checkpoint (transformers-written, or quantized in the tools' layout), loads it through the
real loader on two ranks and in this process (rank 0 of 1), and runs the same prefill and decode steps through
tests/models/paged_runner.py. fp32 throughout: only the order of the row-parallel sums differs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import Phase, given, settings

from tests.distributed.marks import cpu_kernels
from tests.distributed.tp_workers import TPWorkers
from tests.helpers import seeds
from tests.models.checkpoints import tiny_config, write_checkpoint
from tests.models.paged_runner import PagedRunner
from tests.quant.checkpoints import awq_settings, gptq_settings, write_quantized_checkpoint
from tritonllm.distributed import communication
from tritonllm.models.loader import load_model

pytestmark = cpu_kernels

W = 2
FP32_TOL = dict(atol=2e-5, rtol=1e-4)

CASES = [
    # id, arch, config overrides, quantization settings (None: dense)
    ("llama-tied-gqa", "LlamaForCausalLM", {}, None),
    ("llama-kv-heads-replicated", "LlamaForCausalLM", {"num_key_value_heads": 1}, None),
    ("qwen2-qkv-bias-window", "Qwen2ForCausalLM", {}, None),
    ("qwen3-qk-norm", "Qwen3ForCausalLM", {}, None),
    ("mistral-window", "MistralForCausalLM", {}, None),
    ("llama-awq-g32", "LlamaForCausalLM", {"intermediate_size": 128}, awq_settings(32)),
    ("llama-gptq4-g32", "LlamaForCausalLM", {"intermediate_size": 128}, gptq_settings(4, 32, False, False, "gptq")),
    # down_proj's 96 inputs: 48 per rank, not whole groups of 32, which act-order's kept-whole groups allow.
    ("qwen2-gptq4-actorder", "Qwen2ForCausalLM", {"intermediate_size": 96}, gptq_settings(4, 32, False, True, "gptq")),
]


@pytest.fixture(scope="module")
def workers():
    with TPWorkers(world_size=W) as pool:
        yield pool


def run_checkpoint(path: str, tokens: list[int], prompt_len: int, seed: int) -> dict:
    """Load `path` for this process's tp group; prefill tokens[:prompt_len], then decode the rest one at a time.

    Returns the logits of every step, the per-rank KV head count, and how many all-reduces and all-gathers one
    decode step made."""
    model, config = load_model(path, device="cpu")
    runner = PagedRunner(model, seed=seed)
    logits = runner.step([(0, tokens[:prompt_len])])
    calls = {"all_reduce": 0, "all_gather": 0}
    all_reduce, all_gather = dist.all_reduce, communication._all_gather_single

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    dist.all_reduce = count("all_reduce", all_reduce)
    communication._all_gather_single = count("all_gather", all_gather)
    try:
        for t in tokens[prompt_len:]:
            logits += runner.step([(0, [t])])
    finally:
        dist.all_reduce, communication._all_gather_single = all_reduce, all_gather
    steps = len(tokens) - prompt_len
    return {
        "logits": torch.cat(logits),
        "kv_heads": {layer.num_kv_heads for layer in model.attention_layers()},
        "heads": {layer.num_heads for layer in model.attention_layers()},
        "calls_per_step": {k: v / steps for k, v in calls.items()},
        "layers": config.num_hidden_layers,
    }


@pytest.mark.parametrize(("arch", "overrides", "quant"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
# One example each; no shrinking (a seed is an opaque integer, and every run builds and loads a model).
@settings(max_examples=1, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(seed=seeds())
def test_model_logits_match_one_rank(workers, arch, overrides, quant, seed, tmp_path_factory):
    config = tiny_config(arch, **overrides)
    path = tmp_path_factory.mktemp("tp-model")
    if quant is None:
        write_checkpoint(config, path, seed)
    else:
        write_quantized_checkpoint(config, quant, path, seed)
    tokens = torch.randint(0, config["vocab_size"], (8,), generator=torch.Generator().manual_seed(seed)).tolist()
    workers.submit(run_checkpoint, str(path), tokens, 6, seed)
    reference = run_checkpoint(str(path), tokens, 6, seed)
    results = workers.wait()

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    assert reference["heads"] == {heads} and reference["kv_heads"] == {kv_heads}
    assert reference["calls_per_step"] == {"all_reduce": 0, "all_gather": 0}
    for out in results:
        assert out["heads"] == {heads // W}
        assert out["kv_heads"] == {max(1, kv_heads // W)}
        # The embedding, then one per attention block and one per MLP; one gather of the logits.
        assert out["calls_per_step"] == {"all_reduce": 1 + 2 * out["layers"], "all_gather": 1}
        assert out["logits"].shape == reference["logits"].shape == (len(tokens), config["vocab_size"])
        torch.testing.assert_close(out["logits"], reference["logits"], **FP32_TOL)
    torch.testing.assert_close(results[0]["logits"], results[1]["logits"], atol=0, rtol=0)
