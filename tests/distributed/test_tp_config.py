"""tensor_parallel_size is checked before any worker starts, with messages that say what to change; one rank
runs in the engine's own process."""

import multiprocessing

import pytest
import torch

from tritonllm.runtime.engine_config import EngineConfig
from tritonllm.runtime.executor import UniprocExecutor, check_parallel_config


def test_sizes_below_one_are_refused():
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
            EngineConfig(model="m", tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="must be >= 1"):
        check_parallel_config(0, "cpu")


def test_gpu_count_and_device_are_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match=r"needs 2 GPUs on this host but 1 are visible \(CUDA_VISIBLE_DEVICES=3\)"):
        check_parallel_config(2, "cuda")
    with pytest.raises(ValueError, match="choose the GPUs with CUDA_VISIBLE_DEVICES"):
        check_parallel_config(2, "cuda:1")
    with pytest.raises(ValueError, match="cuda or cpu"):
        check_parallel_config(2, "meta")
    check_parallel_config(2, "cpu")
    check_parallel_config(1, "cuda:0")  # one rank: any device, as before


def test_torchrun_world_size_must_equal_the_size(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2, but tensor_parallel_size=1; pass --tensor-parallel-size 2"):
        check_parallel_config(1, "cpu")
    check_parallel_config(2, "cpu")


def test_one_rank_runs_in_process():
    from tests.runtime.tiny_engine import make_engine

    engine = make_engine()
    assert isinstance(engine.executor, UniprocExecutor) and multiprocessing.active_children() == []
    assert engine.runner is engine.executor.driver_worker.runner and engine.num_blocks == engine.runner.num_blocks
