"""Batch limits: what a user sets is kept; otherwise they follow the GPU's memory, as vLLM's defaults do."""

import pytest
import torch

from tests.runtime.tiny_engine import make_engine
from tritonllm.entrypoints.args import engine_config_from_args
from tritonllm.entrypoints.cli import build_parser
from tritonllm.platform import device_memory
from tritonllm.runtime import engine as engine_module
from tritonllm.runtime.engine_config import LARGE_GPU_MEMORY, EngineConfig

GIB = 2**30


@pytest.mark.parametrize(
    ("memory", "serving", "expected"),
    [
        (None, False, (256, 8192)),  # the CPU
        (24 * GIB, False, (256, 8192)),
        (24 * GIB, True, (256, 8192)),
        (LARGE_GPU_MEMORY - 1, False, (256, 8192)),
        (LARGE_GPU_MEMORY, False, (1024, 16384)),
        (141 * GIB, False, (1024, 16384)),
        (141 * GIB, True, (1024, 8192)),  # a server keeps steps short for inter-token latency
    ],
)
def test_default_batch_limits_follow_the_gpu_memory(memory, serving, expected):
    config = EngineConfig(model="m", serving=serving)
    assert config.batch_limits(memory) == expected


def test_set_batch_limits_are_kept():
    config = EngineConfig(model="m", max_num_seqs=3, max_num_batched_tokens=40)
    for memory in (None, 24 * GIB, 141 * GIB):
        assert config.batch_limits(memory) == (3, 40)
    only_seqs = EngineConfig(model="m", max_num_seqs=7)
    assert only_seqs.batch_limits(141 * GIB) == (7, 16384)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineConfig(model="m", max_num_seqs=0)


def test_the_server_asks_for_serving_defaults():
    parser = build_parser()
    serve = parser.parse_args(["serve"])
    assert engine_config_from_args(serve, "m", serving=True).serving
    generate = parser.parse_args(["generate", "x"])
    config = engine_config_from_args(generate, "m")
    assert not config.serving and config.max_num_seqs is None and config.max_num_batched_tokens is None


def test_the_engine_schedules_with_the_resolved_limits(monkeypatch):
    # The engine asks for the memory of its device; a large GPU is stood in for, so this runs anywhere.
    monkeypatch.setattr(engine_module, "device_memory", lambda requested: 141 * GIB)
    engine = make_engine()
    assert (engine.scheduler.config.max_num_seqs, engine.scheduler.config.max_num_batched_tokens) == (1024, 16384)
    engine = make_engine(max_num_seqs=5, max_num_batched_tokens=12)
    assert (engine.scheduler.config.max_num_seqs, engine.scheduler.config.max_num_batched_tokens) == (5, 12)


def test_device_memory_is_none_off_the_gpu_or_for_a_missing_gpu():
    assert device_memory("cpu") is None
    assert device_memory(f"cuda:{torch.cuda.device_count()}") is None  # refused later, with the engine's message
