"""Bad requests, disconnects, aborts and engine failures: each answered clearly, none disturbing the rest."""

import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn

from tests.entrypoints.serving_utils import (
    API_KEY,
    ENGINE_KWARGS,
    MAX_MODEL_LEN,
    SERVED_NAME,
    free_port,
    metrics,
    wait_for_idle_pool,
)
from tritonllm import SamplingParams

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (path, JSON body or raw bytes, status, fragment of the message, param)
BAD_REQUESTS = [
    (CMPL, b'{"prompt": "x",', 400, "not valid JSON", None),
    (CMPL, b"[1, 2]", 400, "", None),
    (CMPL, {"model": "no-such-model", "prompt": "x"}, 404, "does not exist", "model"),
    (CHAT, {"model": "no-such-model", "messages": MSG}, 404, "does not exist", "model"),
    (CMPL, {}, 400, "Field required", "prompt"),
    (CMPL, {"prompt": []}, 400, "must be a string", "prompt"),
    (CMPL, {"prompt": [1, "a"]}, 400, "must be a string", "prompt"),
    (CMPL, {"prompt": [[1, 2], []]}, 400, "must be a string", "prompt"),
    (CMPL, {"prompt": [1, 2, 100000]}, 400, "outside the vocabulary", "prompt"),
    (CMPL, {"prompt": [-1]}, 400, "outside the vocabulary", "prompt"),
    (CMPL, {"prompt": "x", "temperature": -1}, 400, "temperature", "temperature"),
    (CMPL, {"prompt": "x", "temperature": "hot"}, 400, "valid number", "temperature"),
    (CMPL, {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    (CMPL, {"prompt": "x", "top_k": -3}, 400, "top_k", "top_k"),
    (CMPL, {"prompt": "x", "min_p": 1.5}, 400, "min_p", "min_p"),
    (CMPL, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "presence_penalty"),
    (CMPL, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "repetition_penalty"),
    (CMPL, {"prompt": "x", "n": 0}, 400, "n must be", "n"),
    (CMPL, {"prompt": "x", "n": True}, 400, "valid integer", "n"),
    (CMPL, {"prompt": "x", "n": 1000}, 400, "max_num_seqs", None),  # rejected by the engine itself
    (CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    (CMPL, {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens", "min_tokens"),
    (CMPL, {"prompt": "x", "stop": [""]}, 400, "stop", "stop"),
    (CMPL, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "logprobs"),
    (CMPL, {"prompt": "x", "seed": 1.5}, 400, "valid integer", "seed"),
    (CMPL, {"prompt": "x", "logit_bias": {"5": 1.0}}, 400, "not supported", "logit_bias"),
    (CMPL, {"prompt": "x", "suffix": "y"}, 400, "not supported", "suffix"),
    (CMPL, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream", "stream_options"),
    (CMPL, {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "maximum context length", "max_tokens"),
    (CMPL, {"prompt": [7] * (MAX_MODEL_LEN + 1), "max_tokens": 1}, 400, "maximum context length", "prompt"),
    (CMPL, {"prompt": [7] * MAX_MODEL_LEN, "stream": True}, 400, "maximum context length", "prompt"),
    (CHAT, {"messages": []}, 400, "at least 1", "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "Field required", "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "wizard", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "only text", "messages"),
    (CHAT, {"messages": MSG, "max_tokens": 10 * MAX_MODEL_LEN}, 400, "maximum context length", "max_tokens"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "logprobs", "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 99}, 400, "logprobs", "logprobs"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "not supported", "tools"),
    (CHAT, {"messages": MSG, "chat_template": "{{ raise_exception('bad turn') }}"}, 400, "bad turn", "messages"),
    ("/v1/nothing", {}, 404, "Not Found", None),
]


def _post(url: str, body, timeout: float = 60) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {**AUTH, "Content-Type": "application/json"}
        return httpx.post(url, content=body, headers=headers, timeout=timeout)
    return httpx.post(url, json=body, headers=AUTH, timeout=timeout)


def test_bad_requests_get_openai_errors_and_disturb_nothing(server, client, reference_llm):
    # A stream runs through the whole table; it must come out exactly as if alone.
    prompt = [11, 22, 33, 44, 55]
    want = reference_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    streamed: list[str] = []

    def consume() -> None:
        stream = client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        streamed.extend(c.choices[0].text for c in stream if c.choices)

    background = threading.Thread(target=consume)
    background.start()
    problems = []
    for path, body, status, fragment, param in BAD_REQUESTS:
        r = _post(server.url + path, body)
        error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        expected = (status, True, param, True)
        got = (r.status_code, fragment in error.get("message", ""), error.get("param"), set(error) >= {"type", "code"})
        if got != expected:
            problems.append(f"{path} {body!r}: {r.status_code} {r.text[:300]}")
    background.join(120)
    assert not problems, "\n".join(problems)
    assert "".join(streamed) == want.outputs[0].text
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    m = wait_for_idle_pool(server.url)
    assert m["tritonllm:kv_cache_free_blocks"] == m["tritonllm:kv_cache_total_blocks"]


def test_disconnects_and_aborts_free_the_kv_pool(server):
    aborted = "tritonllm:request_success_total{finished_reason=abort}"
    aborted_before = metrics(server.url).get(aborted, 0.0)
    long = {"max_tokens": 100, "ignore_eos": True, "temperature": 0}
    # A streaming client that leaves after two events: two prompts x n=2, four sequences in all.
    body = {"prompt": [[3, 4, 5, 6], [7, 8, 9]], "n": 2, "stream": True, **long}
    with httpx.Client(timeout=60, headers=AUTH) as c:
        with c.stream("POST", f"{server.url}{CMPL}", json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    break
        # A non-streaming client that gives up (its read times out) while its request runs: 100 tokens take
        # far longer than 50 ms even compiled on a GPU (each step is a full engine round trip).
        with pytest.raises(httpx.ReadTimeout):
            c.post(f"{server.url}{CMPL}", json={"prompt": "Hello", **long}, timeout=0.05)
        # And a chat stream closed at once.
        chat = {"messages": MSG, "stream": True, **long}
        with c.stream("POST", f"{server.url}{CHAT}", json=chat) as r:
            assert r.status_code == 200
    m = wait_for_idle_pool(server.url)
    assert m["tritonllm:num_requests_running"] == 0 and m["tritonllm:num_requests_waiting"] == 0
    assert m["tritonllm:kv_cache_free_blocks"] == m["tritonllm:kv_cache_total_blocks"]
    # Ended by the disconnects, not by running out their 100 tokens: 2 (two prompts) + 1 + 1 engine requests.
    assert m.get(aborted, 0.0) - aborted_before == 4
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@contextmanager
def _serve_in_thread(app):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_engine_failure_fails_requests_instead_of_hanging(tiny_model_dir):
    from tritonllm.entrypoints.openai.server import create_app
    from tritonllm.runtime.engine import LLMEngine
    from tritonllm.runtime.engine_config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), **ENGINE_KWARGS))
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = failing_step
    with _serve_in_thread(create_app(engine, [SERVED_NAME])) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(
            model=SERVED_NAME, prompt="Hello", max_tokens=20, stream=True, extra_body={"ignore_eos": True}
        )
        with pytest.raises(openai.APIError, match="injected step failure"):
            for _ in stream:
                pass
        r = httpx.post(f"{url}{CMPL}", json={"prompt": "Hello", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "injected step failure" in r.json()["error"]["message"]
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 503 and "injected step failure" in health.json()["error"]["message"]
