"""The built-in default model: held-out perplexity through our engine, transformers, and 4-bit versions of it."""

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import DEVICE
from tritonllm.entrypoints.llm import DEFAULT_MODEL, LLM
from tritonllm.evaluate import perplexity
from tritonllm.quant.rtn import quantize_checkpoint, rtn_settings
from tritonllm.runtime.tokenizer import Tokenizer

EXCERPT = json.loads((Path(__file__).parent.parent / "data" / "heldout_excerpt.json").read_text())
CARD_PERPLEXITY = EXCERPT["perplexity"]["value"]  # quoted in docs/default_model.md
# The CPU default: on a GPU an engine would otherwise take 90% of its memory, which parallel test processes share.
KV_BUDGET = dict(kv_cache_memory=256 * 2**20)


@pytest.fixture(scope="module")
def sequences() -> list[list[int]]:
    tokenizer = Tokenizer(DEFAULT_MODEL)
    eot = tokenizer.eos_token_id
    return [[eot] + tokenizer.encode(doc["text"], add_special_tokens=False) for doc in EXCERPT["documents"]]


def transformers_perplexity(path: str, sequences: list[list[int]]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for ids in sequences:
        x = torch.tensor([ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(x).logits[0, :-1].float(), dim=-1)
        nll -= logprobs.gather(1, x[0, 1:, None]).sum().item()
        count += len(ids) - 1
    return math.exp(nll / count)


@pytest.fixture(scope="module")
def float_llm() -> LLM:
    return LLM(dtype="float32", device=str(DEVICE), **KV_BUDGET)


@pytest.fixture(scope="module")
def float_perplexity(float_llm, sequences) -> float:
    return perplexity(float_llm, sequences)


def test_default_model_card_is_consistent():
    card = (Path(__file__).parents[2] / "docs" / "default_model.md").read_text()
    assert f"{CARD_PERPLEXITY:.2f}" in card, "docs/default_model.md must quote the excerpt perplexity"


def test_engine_perplexity_matches_the_model_card(float_perplexity):
    assert float_perplexity == pytest.approx(CARD_PERPLEXITY, rel=0.005)


def test_engine_perplexity_matches_transformers(float_perplexity, sequences):
    assert float_perplexity == pytest.approx(transformers_perplexity(DEFAULT_MODEL, sequences), rel=0.002)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_4bit_versions_stay_close(method, sequences, float_llm, tmp_path):
    """Round-to-nearest 4-bit (group 64) costs some perplexity, but a bounded amount (docs/default_model.md has
    the whole-excerpt figures). One document keeps the interpreter run short."""
    path = quantize_checkpoint(DEFAULT_MODEL, tmp_path / method, rtn_settings(method, group_size=64))
    reference = perplexity(float_llm, sequences[:1])
    quantized = perplexity(LLM(str(path), dtype="float16", device=str(DEVICE), **KV_BUDGET), sequences[:1])
    print(f"{method} 4-bit g64 perplexity {quantized:.3f} vs float {reference:.3f}")
    assert reference * 0.98 < quantized < reference * 1.25
