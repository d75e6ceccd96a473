"""Tensor parallelism end to end on the CPU (gloo, Triton's interpreter): two spawned ranks give the greedy tokens one
rank gives, for the bf16 default model and its AWQ and GPTQ round-to-nearest copies; logprobs travel back from rank
0; a model class registered in test code runs in every worker; a torchrun launch of `tritonllm generate` prints
what one process prints; workers exit cleanly on shutdown.

The default model's predictions are confident, so the ranks' different summation order cannot flip a greedy token.
"""

import json
import math
import multiprocessing
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.marks import two_ranks
from tritonllm import LLM, SamplingParams, register_model
from tritonllm.entrypoints.llm import DEFAULT_MODEL
from tritonllm.models.llama import LlamaForCausalLM

pytestmark = two_ranks

PROMPTS = ["def main(", "import os\n"]
# One KV budget for both sizes: a rank of two holds half the KV heads, so its pool has twice the blocks.
ENGINE = dict(max_model_len=128, kv_cache_memory=2**20, seed=0)
DOWN_PROJ_K = 448  # the default model's intermediate size: down_proj's K, split over the ranks


def run(model: str, tp: int, params: SamplingParams, prompts: list[str] = PROMPTS):
    """(outputs, KV blocks per rank, worker exit codes after shutdown) of one engine."""
    llm = LLM(model, tensor_parallel_size=tp, **ENGINE)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        num_blocks = llm.engine.num_blocks
    finally:
        llm.shutdown()
    procs = getattr(llm.engine.executor, "_procs", [])
    return outs, num_blocks, [p.exitcode for p in procs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, prompt_logprobs=1)


@pytest.fixture(scope="module")
def one_rank():
    """The default model's outputs on one rank: the reference for two ranks and for torchrun."""
    return run(DEFAULT_MODEL, 1, GREEDY)


def test_bf16_default_model_two_ranks_match_one(one_rank):
    two, blocks2, exits = run(DEFAULT_MODEL, 2, GREEDY)
    one, blocks1, _ = one_rank
    assert exits == [0, 0] and multiprocessing.active_children() == []  # clean shutdown: no zombies
    assert blocks2 == 2 * blocks1  # each rank holds half the KV heads: the model really is sharded
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        for lp1, lp2 in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            token = next(iter(lp1))  # the sampled token comes first
            assert next(iter(lp2)) == token
            assert math.isclose(lp1[token].logprob, lp2[token].logprob, abs_tol=0.1)
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for p1, p2 in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            token = next(iter(p1))  # the actual prompt token
            assert math.isclose(p1[token].logprob, p2[token].logprob, abs_tol=0.1)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from tritonllm.quant.rtn import quantize_checkpoint, rtn_settings

    root = tmp_path_factory.mktemp("rtn")
    group_size = 32
    assert (DOWN_PROJ_K // 2) % group_size == 0  # a row-parallel rank must hold whole quant groups
    return {m: str(quantize_checkpoint(DEFAULT_MODEL, root / m, rtn_settings(m, group_size))) for m in ("awq", "gptq")}


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_quantized_two_ranks_match_one(quantized, method):
    # One prefill step (the 4-bit GEMMs are slow under the interpreter): the first token, its logprob, and the
    # logprob of every prompt token, all from every quantized layer at its per-rank shard.
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, prompt_logprobs=0)
    (two,), blocks2, exits = run(quantized[method], 2, params, PROMPTS[:1])
    (one,), blocks1, _ = run(quantized[method], 1, params, PROMPTS[:1])
    assert exits == [0, 0] and blocks2 == 2 * blocks1
    assert two.outputs[0].token_ids == one.outputs[0].token_ids
    want = one.outputs[0].logprobs + one.prompt_logprobs[1:]
    for a, b in zip(want, two.outputs[0].logprobs + two.prompt_logprobs[1:], strict=True):
        token = next(iter(a))
        assert math.isclose(a[token].logprob, b[token].logprob, abs_tol=0.1)


# ---- a model class registered by the user, in a module the workers import ----------------------------------

BOOSTED = 1234


class BoostedLlama(LlamaForCausalLM):
    """The default Llama with one token forced to win: if the workers ran it, every output token is BOOSTED."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        logits[:, BOOSTED] = logits.amax(dim=-1) + 100.0
        return logits


def test_user_registered_model_runs_in_every_worker(tmp_path):
    register_model("BoostedLlamaForCausalLM", BoostedLlama)  # as a user's script would, before building the engine
    model = tmp_path / "boosted"
    shutil.copytree(DEFAULT_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["BoostedLlamaForCausalLM"]}))
    outs, _, exits = run(str(model), 2, SamplingParams(temperature=0.0, max_tokens=2), PROMPTS[:1])
    assert outs[0].outputs[0].token_ids == [BOOSTED] * 2
    assert exits == [0, 0]


def test_torchrun_generate_prints_what_one_process_prints(one_rank):
    """Every launched process runs the CLI; rank 0 drives the engine, rank 1 follows and prints nothing."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "tritonllm", "generate", PROMPTS[0]]
    options = ["--tensor-parallel-size", "2", "--max-tokens", "6", "--max-model-len", "128", "--num-gpu-blocks", "32"]
    result = subprocess.run(command + options, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == one_rank[0][0].outputs[0].text + "\n"
