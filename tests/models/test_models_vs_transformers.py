"""Each built-in architecture, loaded from a transformers-written checkpoint, reproduces transformers' logits
through prefill and decode on a paged KV cache; sequences batched together equal the same sequences run alone."""

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from tests.helpers import DEVICE, seeds
from tests.models.checkpoints import builtin_architectures, hf_logits, tiny_config, write_checkpoint
from tests.models.paged_runner import PagedRunner
from tritonllm.models.loader import load_model

ARCHS = builtin_architectures()

# One example per case: each runs a few model steps through Triton's interpreter; no shrinking, which would
# repeat them for minutes (the failing seed is printed and reproduces the case).
MODEL_SETTINGS = settings(max_examples=1, phases=[Phase.explicit, Phase.reuse, Phase.generate])

# fp32 end to end: differences come only from summation order, so the bound is tight.
FP32_TOL = dict(atol=2e-5, rtol=1e-4)


def test_every_builtin_architecture_is_covered():
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(ARCHS)


# The tiny configs cover: tied (Llama, Qwen3) and untied (Mistral, Qwen2) heads, llama3 rope scaling (Llama),
# a window on every layer (Mistral) and on layers >= max_window_layers only (Qwen2), q/k norms (Qwen3).
@pytest.mark.parametrize("arch", ARCHS)
@MODEL_SETTINGS
@given(seed=seeds(), prompt_len=st.integers(6, 10), data=st.data())
def test_prefill_and_decode_match_transformers(arch, seed, prompt_len, data, tmp_path_factory):
    """Windows (5 and 6 tokens) are shorter than the 9-13 token sequences, so they slide."""
    config = tiny_config(arch)
    path = tmp_path_factory.mktemp(arch)
    hf = write_checkpoint(config, path, seed)
    model, _ = load_model(str(path), device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    num_decode = 3
    tokens = torch.randint(0, config["vocab_size"], (prompt_len + num_decode,), generator=g).tolist()

    runner = PagedRunner(model, seed=data.draw(seeds(), label="block_seed"))
    logits = runner.step([(0, tokens[:prompt_len])])
    for i in range(prompt_len, prompt_len + num_decode):
        logits += runner.step([(0, [tokens[i]])])
    ours = torch.cat(logits)

    expected = hf_logits(hf, tokens)
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, **FP32_TOL)


# paged_attention writes only the rows of real tokens; padding rows keep uninitialised values, which may
# overflow on their way through the MLP. They are row-local and never read.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("arch", ARCHS)
@MODEL_SETTINGS
@given(seed=seeds(), lens=st.lists(st.integers(2, 7), min_size=3, max_size=3))
def test_batched_sequences_equal_each_alone(arch, seed, lens, tmp_path_factory):
    """Three sequences in one flat batch (one chunked prefill, padding slots -1) match each run by itself."""
    config = tiny_config(arch)
    path = tmp_path_factory.mktemp(arch)
    write_checkpoint(config, path, seed)
    model, _ = load_model(str(path), device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    num_decode = 2
    seqs = [torch.randint(0, config["vocab_size"], (n + num_decode,), generator=g).tolist() for n in lens]

    alone = []
    for i, s in enumerate(seqs):
        runner = PagedRunner(model, seed=seed + i + 1)
        alone.append(runner.step([(0, s)])[0])  # the whole sequence in one prefill

    # Seqs 0 and 1 prefill while seq 2 prefills in two chunks (the second one mixed with decodes); 3 padding
    # tokens with slot -1 trail the middle step.
    runner = PagedRunner(model, seed=seed)
    half = max(1, lens[2] // 2)
    got = [[] for _ in seqs]
    plan = [
        [(0, seqs[0][: lens[0]]), (1, seqs[1][: lens[1]]), (2, seqs[2][:half])],
        [(2, seqs[2][half : lens[2] + 1]), (0, [seqs[0][lens[0]]]), (1, [seqs[1][lens[1]]])],
        [(1, [seqs[1][lens[1] + 1]]), (2, [seqs[2][lens[2] + 1]]), (0, [seqs[0][lens[0] + 1]])],
    ]
    for step, batch in enumerate(plan):
        out = runner.step(batch, num_pad=3 if step == 1 else 0)
        for (seq_id, _), logits in zip(batch, out, strict=True):
            got[seq_id].append(logits)
    for i in range(len(seqs)):
        torch.testing.assert_close(torch.cat(got[i]), alone[i], atol=1e-5, rtol=1e-5)


def test_sliding_window_changes_the_result(tmp_path):
    """The window in the Mistral tiny config is shorter than the sequence: full attention would differ."""
    config = tiny_config("MistralForCausalLM")
    write_checkpoint(config, tmp_path, seed=3)
    model, cfg = load_model(str(tmp_path), device=DEVICE)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.sliding_window + 4,), generator=torch.Generator().manual_seed(3))
    windowed = PagedRunner(model, seed=1).step([(0, tokens.tolist())])[0]
    for layer in model.attention_layers():
        layer.sliding_window = None
    full = PagedRunner(model, seed=1).step([(0, tokens.tolist())])[0]
    n = cfg.sliding_window
    torch.testing.assert_close(windowed[:n], full[:n], atol=1e-5, rtol=1e-5)
    assert (windowed[n:] - full[n:]).abs().max() > 1e-3
