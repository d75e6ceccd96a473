"""Mixed steps (prefill chunks next to decodes) through padded static buffers, the path CUDA graphs replay: token
buckets, and equality with the eager path through the real kernels. On CPU the buffers run eagerly
(use_graphs=False): everything but the capture itself. Where CUDA exists the same test also replays graphs."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import DEVICE, seeds
from tests.models.checkpoints import tiny_config
from tests.runtime.test_cuda_graphs import seeded_runner
from tritonllm.platform import HAS_CUDA, INTERPRET
from tritonllm.runtime.mixed_graphs import MIXED_TOKEN_LIMIT, MixedGraphRunner, mixed_token_buckets
from tritonllm.runtime.scheduler import Scheduler, SchedulerConfig
from tritonllm.runtime.step_inputs import build_step_inputs
from tritonllm.sampling_params import SamplingParams

GRAPH_MODES = [False] + ([True] if HAS_CUDA and not INTERPRET and DEVICE.type == "cuda" else [])


@given(max_tokens=st.integers(1, 20000), limit=st.integers(1, 10000))
def test_token_buckets_cover_every_step_with_bounded_padding(max_tokens, limit):
    buckets = mixed_token_buckets(max_tokens, limit)
    top = min(max_tokens, limit)
    assert buckets == sorted(set(buckets)) and buckets[-1] == top and buckets[0] >= 1
    for a, b in zip(buckets, buckets[1:], strict=False):
        assert b - a <= (256 if b <= 2048 else 1024)  # a step pads by at most that many tokens


def test_token_bucket_examples():
    assert mixed_token_buckets(8192) == [
        256,
        512,
        768,
        1024,
        1280,
        1536,
        1792,
        2048,
        3072,
        4096,
        5120,
        6144,
        7168,
        8192,
    ]
    assert mixed_token_buckets(100) == [100]
    assert mixed_token_buckets(1000) == [256, 512, 768, 1000]
    assert mixed_token_buckets(10**6)[-1] == MIXED_TOKEN_LIMIT
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        mixed_token_buckets(0)


@pytest.mark.parametrize("use_graphs", GRAPH_MODES)
@settings(max_examples=2)
@given(seed=seeds(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_padded_mixed_steps_match_eager(tmp_path_factory, use_graphs, seed, dtype):
    path = tmp_path_factory.mktemp("tiny")
    config = tiny_config("LlamaForCausalLM", vocab_size=97, num_hidden_layers=1, max_position_embeddings=64)
    (path / "config.json").write_text(json.dumps(config))
    block_size, num_blocks, max_model_len, max_num_seqs = 4, 48, 32, 5
    eager = seeded_runner(str(path), dtype, num_blocks, block_size, seed)
    padded = seeded_runner(str(path), dtype, num_blocks, block_size, seed)
    padded.capture_decode_graphs(max_num_seqs, max_model_len, use_graphs=use_graphs, max_num_batched_tokens=24)
    mixed = padded.mixed_graphs
    assert mixed.buckets == [24]

    # A small token budget chunks prompts, and staggered arrivals put prefills next to decodes.
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=24,
        )
    )
    rng = random.Random(seed)
    pending = [[rng.randrange(97) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    mixed_steps = 0
    while pending or scheduler.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            scheduler.add_request(str(len(pending)), pending.pop(), SamplingParams(max_tokens=rng.randint(1, 6)))
        out = scheduler.schedule()
        if out.is_empty:
            scheduler.update_from_output(out, [])
            continue
        assert mixed.can_run(out)
        mixed_steps += not padded.decode_graphs.can_run(out)
        expected = eager.execute(out).sampled_logits
        actual = padded.execute(out).sampled_logits  # decode steps: the decode buffers; the others: the mixed ones
        assert actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)
        scheduler.update_from_output(out, expected.argmax(dim=-1).tolist())
    assert mixed_steps >= 2
    # The padding rows wrote nothing: the caches agree everywhere, unused slots included.
    torch.testing.assert_close(padded.kv_cache.float(), eager.kv_cache.float(), atol=tol, rtol=tol)


def test_steps_that_do_not_fit_run_eagerly(tmp_path):
    config = tiny_config("LlamaForCausalLM", vocab_size=97, num_hidden_layers=1, max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    runner = seeded_runner(str(tmp_path), torch.float32, 40, 4, 0)
    mixed = MixedGraphRunner(runner.model, 32, 4, 2, [8], DEVICE, use_graphs=False)
    scheduler = Scheduler(SchedulerConfig(max_model_len=32, num_blocks=40, block_size=4, max_num_batched_tokens=64))
    for i, n in enumerate([3, 4, 9]):
        scheduler.add_request(str(i), list(range(1, n + 1)), SamplingParams(max_tokens=2))
    out = scheduler.schedule()  # 16 tokens of 3 sequences: over both the token and the sequence limit
    assert not mixed.can_run(out)
    with pytest.raises(ValueError, match="eagerly"):
        mixed.run(build_step_inputs(out.scheduled, 4, DEVICE))
    scheduler.update_from_output(out, [1, 1, 1])
    out = scheduler.schedule()  # three decodes: 3 tokens, but 3 sequences > 2
    assert not mixed.can_run(out)
    assert mixed.can_run(out) is False and not mixed.can_run(out, prompt_logit_seq_ids={0})
