"""The offline API, `LLM(...).generate / .chat`, as vLLM users call it."""

import math

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from tests.runtime.tiny_engine import (
    ENGINE_DEFAULTS,
    free_blocks_equal_total,
    fresh_thread,
    greedy,
    hf_logprobs,
    random_prompt,
    run_alone,
    tiny_model_dir,
)
from tritonllm import LLM, SamplingParams
from tritonllm.entrypoints.llm import DEFAULT_MODEL
from tritonllm.outputs import CompletionOutput, RequestOutput


def make_llm(**kwargs) -> LLM:
    return LLM(str(tiny_model_dir()), **{**ENGINE_DEFAULTS, **kwargs})


@fresh_thread
def test_generate_returns_outputs_in_the_given_order_with_vllm_shapes():
    llm = make_llm()
    tokenizer = llm.get_tokenizer()
    ids = [random_prompt(11, 5), random_prompt(12, 3)]
    text = "Hello, world!"
    prompts = [text, ids[0], {"prompt_token_ids": ids[1]}, {"prompt": text}]
    # The first prompts generate the most, so they finish last: order must not follow completion.
    max_tokens = [4, 3, 2, 1]
    outputs = llm.generate(prompts, [greedy(m, ignore_eos=True) for m in max_tokens], use_tqdm=False)

    assert len(outputs) == len(prompts)
    expected_ids = [tokenizer.encode(text), ids[0], ids[1], tokenizer.encode(text)]
    for out, prompt_ids, m, prompt in zip(outputs, expected_ids, max_tokens, prompts, strict=True):
        assert isinstance(out, RequestOutput) and out.finished
        assert out.prompt_token_ids == prompt_ids
        assert out.prompt == (text if isinstance(prompt, str) or "prompt" in prompt else None)
        assert out.prompt_logprobs is None and isinstance(out.request_id, str)
        (completion,) = out.outputs
        assert isinstance(completion, CompletionOutput)
        assert completion.index == 0 and completion.finished()
        assert (completion.finish_reason, completion.stop_reason) == ("length", None)
        assert completion.cumulative_logprob is None and completion.logprobs is None
        assert len(completion.token_ids) == m
        assert completion.text == tokenizer.decode(completion.token_ids)
    assert len({o.request_id for o in outputs}) == len(outputs)

    # One prompt (here one list of ids) gives a list of one.
    (single,) = llm.generate(ids[1], greedy(2, ignore_eos=True), use_tqdm=False)
    assert single.outputs[0].token_ids == outputs[2].outputs[0].token_ids
    assert free_blocks_equal_total(llm.engine)


@fresh_thread
def test_generate_refuses_bad_input_and_leaves_nothing_behind():
    llm = make_llm(max_model_len=32)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [greedy(1), greedy(1)], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[7, 8], list(range(6, 60))], greedy(1), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and free_blocks_equal_total(llm.engine)
    (out,) = llm.generate([[7, 8]], greedy(2, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == run_alone([7, 8], greedy(2, ignore_eos=True)).token_ids


@pytest.mark.parametrize(
    "dtype, torch_dtype, tol",
    [
        ("auto", torch.float32, 1e-4),  # the checkpoint's dtype
        ("float32", torch.float32, 1e-4),
        ("float16", torch.float16, 0.1),
        ("bfloat16", torch.bfloat16, 0.5),
    ],
)
@fresh_thread
def test_dtype(dtype, torch_dtype, tol):
    """Weights and KV cache in the chosen dtype; prompt logprobs agree with transformers' fp32 within the
    dtype's rounding."""
    llm = make_llm(dtype=dtype)
    assert next(llm.engine.model.parameters()).dtype == torch_dtype
    assert llm.engine.runner.kv_cache.dtype == torch_dtype
    prompt = random_prompt(21, 6)
    (out,) = llm.generate([prompt], greedy(2, ignore_eos=True, prompt_logprobs=0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
    expected = hf_logprobs(prompt)
    for i in range(1, len(prompt)):
        got = out.prompt_logprobs[i][prompt[i]].logprob
        assert math.isclose(got, float(expected[i - 1, prompt[i]]), abs_tol=tol), (i, got)
    if torch_dtype == torch.float32:
        assert out.outputs[0].token_ids == run_alone(prompt, greedy(2, ignore_eos=True)).token_ids


@fresh_thread
def test_chat_renders_the_tokenizer_config_template():
    llm = make_llm()
    conversations = [
        [{"role": "user", "content": "Hello, world!"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Café?"},
            {"role": "assistant", "content": "Oui."},
            {"role": "user", "content": "Merci"},
        ],
    ]
    reference = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir()))
    params = greedy(2, ignore_eos=True)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    assert len(outputs) == 2
    for conversation, out in zip(conversations, outputs, strict=True):
        text = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert text.startswith("<s>") and text.endswith("<|assistant|>\n")
        assert out.prompt == text
        assert out.prompt_token_ids == reference.encode(text, add_special_tokens=False)
    # The same as generating from the rendered prompts.
    plain = llm.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outputs], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]

    # One conversation (a list of messages) gives a list of one.
    (single,) = llm.chat(conversations[0], greedy(1, ignore_eos=True), use_tqdm=False)
    assert single.outputs[0].token_ids == outputs[0].outputs[0].token_ids[:1]


@fresh_thread
def test_progress_bar_on_and_off_give_the_same_outputs(capsys):
    llm = make_llm()
    prompts = [random_prompt(31, 4), random_prompt(32, 3)]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=2, ignore_eos=True)
    quiet = llm.generate(prompts, params, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    shown = llm.generate(prompts, params, use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err
    assert [o.outputs[0].token_ids for o in quiet] == [o.outputs[0].token_ids for o in shown]


@fresh_thread
def test_engine_stats_are_readable():
    """KV usage, prefix-cache hit rate and preemptions, after runs that exercise each."""
    llm = make_llm(num_gpu_blocks=6, max_num_batched_tokens=8)
    prefix = random_prompt(41, 9)
    llm.generate([prefix + [7]], greedy(1), use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_running == stats.num_waiting == 0
    assert stats.prefix_cache_hit_rate == 0.0

    # Two requests that cannot both hold their blocks: one is preempted; both reuse the cached prefix.
    llm.generate([prefix + [8], prefix + [9]], greedy(8, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions >= 1
    assert stats.prefix_cache_hits >= 16 and 0 < stats.prefix_cache_hit_rate < 1
    assert stats.kv_cache_usage == 0.0 and free_blocks_equal_total(llm.engine)


@fresh_thread
def test_default_model_is_the_builtin_one():
    llm = LLM(num_gpu_blocks=4)
    assert llm.engine.config.model == DEFAULT_MODEL
    (out,) = llm.generate("import os\n", greedy(2), use_tqdm=False)
    assert out.finished and 1 <= len(out.outputs[0].token_ids) <= 2
