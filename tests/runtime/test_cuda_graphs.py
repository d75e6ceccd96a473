"""Decode steps through padded static buffers (the CUDA-graph path): buckets, padding rows, and equality with the
eager path through the real kernels. On CPU the padded buffers run eagerly (use_graphs=False): everything but
the capture itself. Where CUDA exists, the same test also replays captured graphs."""

from __future__ import annotations

import contextlib
import gc
import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import DEVICE, seeds
from tests.models.checkpoints import tiny_config
from tests.runtime.scheduled_batches import scheduled_batch
from tritonllm.models.loader import load_model
from tritonllm.platform import HAS_CUDA, INTERPRET
from tritonllm.runtime.cuda_graphs import (
    CAPTURE_SIZE_LIMIT,
    DecodeInputs,
    capture_graphs,
    capture_sizes,
    decode_rows,
    is_decode_step,
    padded_size,
)
from tritonllm.runtime.model_runner import ModelRunner
from tritonllm.runtime.scheduler import Scheduler, SchedulerConfig
from tritonllm.runtime.scheduler_output import ScheduledSequence, SchedulerOutput
from tritonllm.runtime.sequence import Sequence
from tritonllm.runtime.step_inputs import build_step_inputs
from tritonllm.sampling_params import SamplingParams

GRAPH_MODES = [False] + ([True] if HAS_CUDA and not INTERPRET and DEVICE.type == "cuda" else [])


# ---- buckets ----------------------------------------------------------------------------------------


@given(max_num_seqs=st.integers(1, 600), limit=st.integers(1, 300))
def test_capture_sizes_cover_every_batch_with_little_padding(max_num_seqs, limit):
    sizes = capture_sizes(max_num_seqs, limit)
    top = min(max_num_seqs, limit)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == top
    for n in range(1, top + 1):
        b = padded_size(n, sizes)
        assert b in sizes and n <= b < n + 8 and b <= 2 * n
        assert padded_size(n, sizes[: sizes.index(b)]) is None  # the smallest bucket that holds n
    assert padded_size(top + 1, sizes) is None


def test_capture_sizes_examples():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(1000)[-1] == CAPTURE_SIZE_LIMIT
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_sizes(3) == [1, 2, 3]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


# ---- padded inputs ----------------------------------------------------------------------------------


@given(seed=seeds(), num_seqs=st.integers(1, 11), block_size=st.sampled_from([1, 2, 4, 16]))
def test_padded_decode_rows_match_the_eager_inputs(seed, num_seqs, block_size):
    rng = random.Random(seed)
    batch = scheduled_batch(rng, num_seqs, block_size, num_blocks=80)
    sizes = capture_sizes(16)
    size = padded_size(num_seqs, sizes)
    ids, positions, slots, seq_lens, tables = decode_rows(batch, block_size, size)
    assert len(ids) == len(positions) == len(slots) == len(seq_lens) == len(tables) == size

    eager = build_step_inputs(batch, block_size, torch.device("cpu"))
    meta = eager.attn_metadata
    n = num_seqs
    assert ids[:n] == eager.input_ids.tolist()
    assert positions[:n] == eager.positions.tolist()
    assert slots[:n] == meta.slot_mapping.tolist()
    assert seq_lens[:n] == meta.seq_lens.tolist()
    for row, table in zip(meta.block_tables.tolist(), tables[:n], strict=True):
        assert row[: len(table)] == table
    assert meta.logits_indices.tolist() == list(range(n)) and eager.num_sampled == n
    # Padding rows compute one harmless token: nothing written, one readable key, finite output.
    pad = size - n
    assert ids[n:] == [0] * pad and positions[n:] == [0] * pad
    assert slots[n:] == [-1] * pad and seq_lens[n:] == [1] * pad and tables[n:] == [[0]] * pad


@given(seed=seeds(), sizes=st.lists(st.integers(1, 12), min_size=2, max_size=4), block_size=st.sampled_from([2, 4]))
def test_static_buffers_hold_exactly_the_latest_step(seed, sizes, block_size):
    """Consecutive fills of shrinking and growing batches: no row or column of an earlier step leaks into the
    rows the kernels read (each row's first cdiv(seq_len, block_size) table entries)."""
    rng = random.Random(seed)
    buckets = capture_sizes(16)
    inputs = DecodeInputs(max_size=16, max_blocks_per_seq=6, device=DEVICE)
    for num_seqs in sizes:
        batch = scheduled_batch(rng, num_seqs, block_size, num_blocks=100)
        size = padded_size(num_seqs, buckets)
        inputs.fill(batch, size, block_size)
        ids, positions, slots, seq_lens, tables = decode_rows(batch, block_size, size)
        meta = inputs.metadata(size, max_model_len=6 * block_size)
        assert inputs.input_ids[:size].tolist() == ids
        assert inputs.positions[:size].tolist() == positions
        assert meta.slot_mapping.tolist() == slots
        assert meta.seq_lens.tolist() == seq_lens
        assert meta.query_start_loc.tolist() == list(range(size + 1))
        read = meta.block_tables.tolist()
        for row, table, seq_len in zip(read, tables, seq_lens, strict=True):
            assert row[: -(-seq_len // block_size)] == table[: -(-seq_len // block_size)]
        assert meta.max_query_len == 1 and meta.max_seq_len == 6 * block_size


def test_fill_rejects_what_no_bucket_holds():
    inputs = DecodeInputs(max_size=4, max_blocks_per_seq=2, device=DEVICE)
    batch = scheduled_batch(random.Random(0), 3, block_size=2, num_blocks=40)
    with pytest.raises(ValueError, match="does not fit"):
        inputs.fill(batch, 2, 2)
    seq = Sequence(9, "9", list(range(5)), 5, None, arrival=0, block_table=[3, 1, 2])  # 3 blocks > 2
    with pytest.raises(ValueError, match="max_model_len"):
        inputs.fill([ScheduledSequence(seq, 4, 1, True)], 1, 2)


def test_only_pure_decode_steps_qualify():
    rng = random.Random(1)
    batch = scheduled_batch(rng, 3, block_size=4, num_blocks=40)

    def out(entries):
        return SchedulerOutput(entries, len(entries), [], 4, [], [])

    assert is_decode_step(out(batch))
    assert not is_decode_step(out([]))
    assert not is_decode_step(out(batch), prompt_logit_seq_ids={batch[1].seq.seq_id})
    prefill = ScheduledSequence(batch[0].seq, 0, batch[0].seq.num_tokens, True)
    assert not is_decode_step(out([prefill, *batch[1:]]))
    chunk = ScheduledSequence(batch[0].seq, batch[0].num_computed_tokens, 1, False)  # one prompt token, unsampled
    assert not is_decode_step(out([chunk, *batch[1:]]))


# ---- through the model ------------------------------------------------------------------------------


def seeded_runner(path: str, dtype: torch.dtype, num_blocks: int, block_size: int, seed: int) -> ModelRunner:
    model, config = load_model(path, dtype=dtype, load_format="dummy", device=DEVICE)
    runner = ModelRunner(model, config, block_size, DEVICE, dtype)
    runner.allocate_kv_cache(num_blocks)
    # Random, not zero: a stray write to any slot (a padding row's, say) changes the final cache.
    g = torch.Generator().manual_seed(seed)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=g).to(dtype))
    return runner


@pytest.mark.parametrize("use_graphs", GRAPH_MODES)
@settings(max_examples=2)
@given(seed=seeds(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_padded_decode_matches_eager(tmp_path_factory, use_graphs, seed, dtype):
    path = tmp_path_factory.mktemp("tiny")
    config = tiny_config("LlamaForCausalLM", vocab_size=97, num_hidden_layers=1, max_position_embeddings=64)
    (path / "config.json").write_text(json.dumps(config))
    block_size, num_blocks, max_model_len = 4, 40, 32
    eager = seeded_runner(str(path), dtype, num_blocks, block_size, seed)
    padded = seeded_runner(str(path), dtype, num_blocks, block_size, seed)
    padded.capture_decode_graphs(max_num_seqs=6, max_model_len=max_model_len, use_graphs=use_graphs)
    assert padded.decode_graphs.sizes == [1, 2, 4, 6]

    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=max_model_len, num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=64
        )
    )
    rng = random.Random(seed)
    # Requests of different lengths finish at different steps, so the decode batch shrinks through buckets.
    for i in range(4):
        prompt = [rng.randrange(97) for _ in range(rng.randint(1, 9))]
        scheduler.add_request(str(i), prompt, SamplingParams(max_tokens=rng.randint(2, 5), ignore_eos=True))
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    graph_steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        graph_steps += padded.decode_graphs.can_run(out)
        expected = eager.execute(out).sampled_logits
        actual = padded.execute(out).sampled_logits
        assert actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)
        scheduler.update_from_output(out, expected.argmax(dim=-1).tolist())
    assert graph_steps >= 2
    # The padding rows wrote nothing: the caches agree everywhere, unused slots included.
    torch.testing.assert_close(padded.kv_cache.float(), eager.kv_cache.float(), atol=tol, rtol=tol)


def test_capture_keeps_the_garbage_collector_off_and_restores_it(monkeypatch):
    # A collection during a capture could destroy an unreachable graph of an earlier engine inside it, which CUDA
    # refuses. Stand-ins for the CUDA calls let this run on any machine.
    class FakeGraph:
        pass

    captured = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool: contextlib.nullcontext())

    def forward(size):
        captured.append((size, gc.isenabled()))
        return torch.full((size,), float(size))

    assert gc.isenabled()
    graphs, outputs = capture_graphs(forward, [1, 4, 2], torch.device("cpu"))
    assert gc.isenabled()
    assert captured == [(4, False), (4, False), (2, False), (2, False), (1, False), (1, False)]
    assert sorted(graphs) == [1, 2, 4] and all(outputs[s].tolist() == [float(s)] * s for s in (1, 2, 4))

    def failing(size):
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        capture_graphs(failing, [1], torch.device("cpu"))
    assert gc.isenabled()
