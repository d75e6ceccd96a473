"""Stop conditions through the engine, against each request's known greedy output: stop strings cut exactly,
stop_token_ids, every EOS id of config.json and generation_config.json, ignore_eos, min_tokens, max_tokens; and
when a request is reported (every step, or only once finished)."""

from functools import lru_cache

import pytest

from tests.runtime.tiny_engine import (
    EOS,
    free_blocks_equal_total,
    fresh_thread,
    greedy,
    make_engine,
    random_prompt,
    run_to_completion,
    variant_dir,
)
from tritonllm.outputs import CompletionOutput
from tritonllm.runtime.tokenizer import Tokenizer
from tritonllm.sampling_params import RequestOutputKind, SamplingParams

# Fixed prompts: the stop strings are built from what the model makes of them.
PROMPTS = [random_prompt(100 + i, 4 + i) for i in range(3)]
MAX_TOKENS = 8
SHORT = 3


@lru_cache(maxsize=1)
def _references() -> tuple[list[CompletionOutput], CompletionOutput]:
    """The greedy output of each prompt (one batch: batching changes no answer), and of prompt 1 cut at SHORT."""
    engine = make_engine()
    ids = [engine.add_request(None, p, greedy(MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]
    short = engine.add_request(None, PROMPTS[1], greedy(SHORT, ignore_eos=True))
    outs = run_to_completion(engine)
    return [outs[i].outputs[0] for i in ids], outs[short].outputs[0]


def reference(i: int) -> CompletionOutput:
    return _references()[0][i]


def first_new(tokens: list[int], start: int = 1) -> int:
    """Index of the first token (from `start`) that does not occur earlier in `tokens`."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def stop_string_across_tokens(tokenizer: Tokenizer, tokens: list[int], text: str) -> tuple[str, bool] | None:
    """A piece of `text` that ends inside a generated token and starts in the one before, inside it when it can
    (then the second value is True), else at its start. None if no two adjacent tokens decode cleanly."""
    pieces = [tokenizer.decode([t]) for t in tokens]
    pairs = [
        (a, b)
        for a, b in zip(pieces[:-1], pieces[1:], strict=True)
        # Whole characters on their own (no partial UTF-8), so both appear verbatim in the text.
        if a and b and "\ufffd" not in a + b and (a + b) in text
    ]
    for a, b in sorted(pairs, key=lambda p: len(p[0]) < 2):
        return (a[1:] + b[:1], True) if len(a) >= 2 else (a + b[:1], False)
    return None


@fresh_thread
def test_stop_strings_cut_exactly():
    engine = make_engine()
    tokenizer = engine.tokenizer
    cases = {}
    for i in range(len(PROMPTS)):
        ref = reference(i)
        found = stop_string_across_tokens(tokenizer, ref.token_ids, ref.text)
        if found is None:
            continue
        stop, mid_token = found
        for include in (False, True):
            params = greedy(
                MAX_TOKENS, ignore_eos=True, stop=["not in the text", stop], include_stop_str_in_output=include
            )
            cases[engine.add_request(None, PROMPTS[i], params)] = (ref, stop, include, mid_token)
    assert any(mid_token for *_, mid_token in cases.values()), "no prompt gave a stop string starting mid-token"
    outs = run_to_completion(engine)

    for request_id, (ref, stop, include, _) in cases.items():
        got = outs[request_id].outputs[0]
        start = ref.text.index(stop)
        assert got.text == ref.text[: start + (len(stop) if include else 0)]
        assert (got.finish_reason, got.stop_reason) == ("stop", stop)
        # Generation ends with the token that completed the stop string.
        n = len(got.token_ids)
        assert got.token_ids == ref.token_ids[:n]
        assert stop in tokenizer.decode(ref.token_ids[:n]) and stop not in tokenizer.decode(ref.token_ids[: n - 1])
    assert free_blocks_equal_total(engine)


@fresh_thread
def test_stop_token_ids_and_min_tokens():
    ref = reference(0)
    k = first_new(ref.token_ids)
    stop_id = ref.token_ids[k]
    engine = make_engine()
    plain = engine.add_request(None, PROMPTS[0], greedy(MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop_id]))
    banned = engine.add_request(
        None, PROMPTS[0], greedy(MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=k + 2)
    )
    first_k = engine.add_request(None, PROMPTS[0], greedy(k, ignore_eos=True))  # the text of the tokens before
    outs = run_to_completion(engine)

    got = outs[plain].outputs[0]
    assert got.token_ids == ref.token_ids[: k + 1]  # the stop token is returned, its text is not
    assert (got.finish_reason, got.stop_reason) == ("stop", stop_id)
    assert got.text == outs[first_k].outputs[0].text

    # min_tokens bans the stop token for the first k + 2 tokens: the greedy path changes where it was chosen.
    got = outs[banned].outputs[0]
    assert got.token_ids[:k] == ref.token_ids[:k] and got.token_ids[k] != stop_id
    assert len(got.token_ids) >= k + 2 and stop_id not in got.token_ids[: k + 2]
    if got.finish_reason == "stop":
        assert got.token_ids[-1] == stop_id and got.stop_reason == stop_id
    else:
        assert len(got.token_ids) == MAX_TOKENS and got.finish_reason == "length"


@fresh_thread
def test_max_tokens_ends_with_length():
    ref = reference(1)
    assert len(ref.token_ids) == MAX_TOKENS and ref.finish_reason == "length" and ref.stop_reason is None
    short = _references()[1]
    assert short.token_ids == ref.token_ids[:SHORT] and short.finish_reason == "length"


@fresh_thread
def test_every_eos_id_of_config_and_generation_config_stops():
    """config.json lists EOS ids [</s>, a], generation_config.json [</s>, b] (as Llama 3 lists several); the
    engine stops on any of them (reason "stop", no stop_reason), unless ignore_eos."""
    refs = [reference(0).token_ids, reference(2).token_ids]
    ka = first_new(refs[0])
    a = refs[0][ka]
    kb = next(
        k
        for k in range(1, MAX_TOKENS)
        if refs[1][k] not in refs[1][:k] + refs[0][: ka + 1] and a not in refs[1][: k + 1]
    )
    b = refs[1][kb]
    path = variant_dir("multi-eos", config={"eos_token_id": [EOS, a]}, generation_config={"eos_token_id": [EOS, b]})
    engine = make_engine(path)
    assert engine.eos_token_ids == {EOS, a, b}
    ids = {
        "a": engine.add_request(None, PROMPTS[0], greedy(MAX_TOKENS)),
        "b": engine.add_request(None, PROMPTS[2], greedy(MAX_TOKENS)),
        "ignore": engine.add_request(None, PROMPTS[0], greedy(MAX_TOKENS, ignore_eos=True)),
        "min": engine.add_request(None, PROMPTS[2], greedy(MAX_TOKENS, min_tokens=kb + 1)),
        # The text of the tokens before each stop.
        "a_text": engine.add_request(None, PROMPTS[0], greedy(ka, ignore_eos=True)),
        "b_text": engine.add_request(None, PROMPTS[2], greedy(kb, ignore_eos=True)),
    }
    finished = run_to_completion(engine)
    outs = {name: finished[request_id].outputs[0] for name, request_id in ids.items()}

    for name, ref, k in (("a", refs[0], ka), ("b", refs[1], kb)):
        got = outs[name]
        assert got.token_ids == ref[: k + 1] and (got.finish_reason, got.stop_reason) == ("stop", None), name
        assert got.text == outs[f"{name}_text"].text
    assert outs["ignore"].token_ids == refs[0] and outs["ignore"].finish_reason == "length"
    got = outs["min"]
    assert got.token_ids[:kb] == refs[1][:kb] and not {EOS, a, b} & set(got.token_ids[: kb + 1])


@fresh_thread
def test_final_only_requests_are_reported_once_finished():
    engine = make_engine()
    final = engine.add_request(None, random_prompt(3, 5), greedy(4, output_kind=RequestOutputKind.FINAL_ONLY))
    streamed = engine.add_request(None, random_prompt(4, 5), greedy(4))
    seen: dict[str, list] = {final: [], streamed: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen[final]) == 1 and seen[final][0].finished
    assert len(seen[streamed]) == 4 and [o.finished for o in seen[streamed]] == [False] * 3 + [True]
    # The one report carries what the streamed request ends with, for the same kind of request.
    assert len(seen[final][0].outputs[0].token_ids) == 4 and seen[final][0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final")
