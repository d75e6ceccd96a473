"""The OpenAI-compatible server, driven over HTTP on 127.0.0.1 by the official openai client.

Expected answers come from the offline LLM on the same checkpoint and options (greedy, so they must agree
token for token whatever else the server batches with them).
"""

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.entrypoints.serving_utils import API_KEY, MAX_MODEL_LEN, SERVED_NAME, metrics
from tests.runtime.tiny_tokenizer import CORPUS
from tritonllm import SamplingParams

CHARS = sorted(set("".join(CORPUS[:6])))
VOCAB = 420
text_prompts = st.lists(st.text(st.sampled_from(CHARS), min_size=1, max_size=30), min_size=1, max_size=3)
id_prompts = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=41), min_size=1, max_size=3)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello, world! Café?"},
]


def greedy(llm, prompts, max_tokens, **kwargs):
    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs), use_tqdm=False)


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED_NAME]
    assert models[0].max_model_len == MAX_MODEL_LEN


@settings(max_examples=3)
@given(prompts=st.one_of(text_prompts, id_prompts), max_tokens=st.integers(1, 3))
def test_completions_equal_offline_generate(client, reference_llm, prompts, max_tokens):
    single = len(prompts) == 1 and isinstance(prompts[0], str)
    body_prompt = prompts[0] if single else prompts
    if len(prompts) == 1 and isinstance(prompts[0], list):
        body_prompt = prompts[0]  # a flat list of token ids is one prompt
    got = client.completions.create(model=SERVED_NAME, prompt=body_prompt, max_tokens=max_tokens, temperature=0)
    want = greedy(reference_llm, prompts, max_tokens)
    assert [c.index for c in got.choices] == list(range(len(prompts)))
    assert [c.text for c in got.choices] == [w.outputs[0].text for w in want]
    assert [c.finish_reason for c in got.choices] == [w.outputs[0].finish_reason for w in want]
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in want)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    assert got.model == SERVED_NAME and got.object == "text_completion"


def test_streaming_completion_equals_offline_generate(client, reference_llm):
    prompt = "The quick brown fox"
    want = greedy(reference_llm, [prompt], 6, ignore_eos=True)[0]
    stream = client.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
        stream=True,
        stream_options={"include_usage": True},
        logprobs=0,
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == want.outputs[0].text
    assert sum(len(c.choices[0].logprobs.tokens) for c in content) == 6
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 6
    assert usage.prompt_tokens == len(want.prompt_token_ids)


def test_completion_logprobs_and_echo(client, reference_llm):
    prompt = "def main():"
    want = greedy(reference_llm, [prompt], 3, logprobs=2, prompt_logprobs=2)[0]
    got = client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True
    ).choices[0]
    assert got.text == prompt + want.outputs[0].text
    lp = got.logprobs
    num_prompt, num_out = len(want.prompt_token_ids), len(want.outputs[0].token_ids)
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == num_prompt + num_out
    )
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == sorted(lp.text_offset)
    for i, entry in enumerate(want.prompt_logprobs[1:] + want.outputs[0].logprobs, start=1):
        token_id = (want.prompt_token_ids + want.outputs[0].token_ids)[i]
        assert lp.token_logprobs[i] == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert lp.tokens[i] == entry[token_id].decoded_token
        assert 1 <= len(lp.top_logprobs[i]) <= 3
    for i in range(num_prompt, num_prompt + num_out):  # greedy: each generated token is the most likely one
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-6)


def test_stop_strings_and_n_with_seed(client, reference_llm):
    prompt = [5, 77, 130, 9, 260]
    free = greedy(reference_llm, [prompt], 6, ignore_eos=True)[0].outputs[0].text
    stop = free[2:4] if len(free) >= 4 else None
    if stop:
        got = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=6, temperature=0, stop=stop)
        want = greedy(reference_llm, [prompt], 6, stop=stop)[0].outputs[0]
        assert got.choices[0].text == want.text
        assert (got.choices[0].finish_reason, got.choices[0].model_extra["stop_reason"]) == (
            want.finish_reason,
            want.stop_reason,
        )
    kwargs = dict(model=SERVED_NAME, prompt=[prompt, prompt[:3]], max_tokens=3, temperature=1.0, seed=7, n=2)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible


def test_chat_completion_equals_offline_chat(client, reference_llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)
    want = reference_llm.chat(MESSAGES, params, use_tqdm=False)[0]
    got = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.outputs[0].text
    assert choice.finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    entries = choice.logprobs.content
    assert len(entries) == len(want.outputs[0].token_ids)
    for entry, token_id, lps in zip(entries, want.outputs[0].token_ids, want.outputs[0].logprobs, strict=True):
        assert entry.logprob == pytest.approx(lps[token_id].logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob

    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == want.outputs[0].text
    assert content[-1].choices[0].finish_reason == want.outputs[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)


def test_raw_stream_is_server_sent_events_ending_in_done(server):
    body = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 2, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_api_key_required_on_v1_only(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=headers, timeout=30)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200


def test_metrics_parse_and_count(server, client):
    names = {
        "tritonllm:num_requests_running",
        "tritonllm:num_requests_waiting",
        "tritonllm:kv_cache_usage_perc",
        "tritonllm:kv_cache_free_blocks",
        "tritonllm:kv_cache_total_blocks",
        "tritonllm:prompt_tokens_total",
        "tritonllm:generation_tokens_total",
        "tritonllm:num_preemptions_total",
        "tritonllm:prefix_cache_queries_total",
        "tritonllm:prefix_cache_hits_total",
        "tritonllm:time_to_first_token_seconds_count",
        "tritonllm:inter_token_latency_seconds_count",
        "tritonllm:e2e_request_latency_seconds_count",
    }
    before = metrics(server.url)
    assert names <= before.keys()
    prompt = list(range(10, 50))  # 40 tokens: two full KV blocks that the second request finds cached
    for _ in range(2):
        got = client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
        )
    after = metrics(server.url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["tritonllm:prompt_tokens_total"] == 2 * got.usage.prompt_tokens
    assert delta["tritonllm:generation_tokens_total"] == 2 * got.usage.completion_tokens
    assert delta["tritonllm:prefix_cache_hits_total"] >= 32
    assert delta["tritonllm:time_to_first_token_seconds_count"] == 2
    assert delta["tritonllm:inter_token_latency_seconds_count"] == 2 * 2
    assert delta["tritonllm:e2e_request_latency_seconds_count"] == 2
