"""A tensor-parallel worker that dies or raises never leaves a caller waiting: the engine fails every request in
flight with an EngineDeadError naming the rank, pid and exit code (or carrying the worker's traceback), refuses
later calls with it, the OpenAI server answers 500 / error events and /health 503, and no worker process is left."""

import multiprocessing
import os
import shutil
import signal
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from tests.distributed.marks import two_ranks
from tritonllm import LLM, SamplingParams
from tritonllm.entrypoints.llm import DEFAULT_MODEL
from tritonllm.runtime.errors import EngineDeadError

pytestmark = two_ranks

ENGINE = dict(tensor_parallel_size=2, max_model_len=128, num_gpu_blocks=32)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


def assert_no_worker_left(pids: list[int]) -> None:
    assert multiprocessing.active_children() == []
    for pid in pids:  # reaped: not even a zombie entry remains
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} is still there"


def test_killed_worker_fails_generate_within_seconds():
    llm = LLM(DEFAULT_MODEL, **ENGINE)
    pids = llm.engine.executor.pids
    real_step, killed_at = llm.engine.step, []

    def step():
        if len(killed_at) == 0 and llm.engine.scheduler.get_stats().num_running == 2:  # mid-generation
            os.kill(pids[1], signal.SIGKILL)
            killed_at.append(time.monotonic())
        return real_step()

    llm.engine.step = step
    dead = rf"rank 1 \(pid {pids[1]}\) died with exit code -9 \(SIGKILL"
    with pytest.raises(EngineDeadError, match=dead):
        llm.generate(["def main(", "import os\n"], LONG, use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 10
    assert_no_worker_left(pids)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(EngineDeadError, match=dead):  # later calls: refused at once, same message
        llm.generate("class A:", LONG, use_tqdm=False)
    with pytest.raises(EngineDeadError, match=dead):
        llm.engine.check_health()
    llm.shutdown()  # idempotent after a failure


def test_worker_exception_at_startup_surfaces_its_message(tmp_path):
    bad = tmp_path / "bad-checkpoint"
    shutil.copytree(DEFAULT_MODEL, bad)
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(EngineDeadError) as info:
        LLM(str(bad), **ENGINE)
    message = str(info.value)
    assert "raised during start-up" in message and "Traceback" in message
    assert "load_model" in message and "safetensors" in message.lower()  # the worker's own error, not a timeout
    assert_no_worker_left([])


# ---- the OpenAI server ------------------------------------------------------------------------------------


@contextmanager
def serve(app):
    from tests.entrypoints.serving_utils import free_port

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def running_requests(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("tritonllm:num_requests_running"):
            return float(line.split()[-1])
    raise AssertionError("no tritonllm:num_requests_running in /metrics")


def test_server_answers_open_requests_with_the_error_and_reports_unhealthy():
    from tritonllm.entrypoints.openai.server import create_app
    from tritonllm.runtime.engine import LLMEngine
    from tritonllm.runtime.engine_config import EngineConfig

    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, **ENGINE))
    pids = engine.executor.pids
    body = {"prompt": "def main(", "max_tokens": 100, "ignore_eos": True}
    try:
        with serve(create_app(engine, ["tp"])) as url, httpx.Client(base_url=url, timeout=120) as client:
            assert client.get("/health").status_code == 200
            plain: list[httpx.Response] = []
            waiter = threading.Thread(target=lambda: plain.append(client.post("/v1/completions", json=body)))
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data: ")) != "data: [DONE]"
                waiter.start()
                while running_requests(url) < 2:  # both requests are in the running batch
                    time.sleep(0.05)
                os.kill(pids[1], signal.SIGKILL)
                events = [line for line in lines if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and '"error"' in events[-2] and "SIGKILL" in events[-2]
            waiter.join(60)
            assert plain[0].status_code == 500 and f"rank 1 (pid {pids[1]})" in plain[0].json()["error"]["message"]
            health = client.get("/health")
            assert health.status_code == 503 and "SIGKILL" in health.json()["error"]["message"]
            later = client.post("/v1/completions", json=body)
            assert later.status_code == 503 and "SIGKILL" in later.json()["error"]["message"]
    finally:
        engine.shutdown()
    assert_no_worker_left(pids)
