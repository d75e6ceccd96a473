import pytest
from hypothesis import given
from hypothesis import strategies as st

from tritonllm import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == (None, [], [], False)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.is_greedy and not p.has_penalties


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("presence_penalty", -2.5),
        ("presence_penalty", 2.01),
        ("frequency_penalty", 3.0),
        ("seed", 1.0),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("prompt_logprobs", -1),
    ],
)
def test_invalid_values_name_field_value_and_range(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert field in message and repr(value) in message and "must be" in message


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(min_tokens=100, max_tokens=None).max_tokens is None


@given(
    temperature=st.floats(0, 3),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(-1, 50),
    stop=st.one_of(st.none(), st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3)),
)
def test_valid_values_are_normalized(temperature, top_p, top_k, stop):
    p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, stop=stop)
    assert isinstance(p.stop, list) and all(isinstance(s, str) for s in p.stop)
    assert p.stop == ([stop] if isinstance(stop, str) else list(stop or []))
    assert p.top_k != 0
    if p.is_greedy:
        # Filters cannot change an argmax, so greedy requests carry none.
        assert (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)
    else:
        assert (p.top_p, p.top_k) == (top_p, -1 if top_k == 0 else top_k)


def test_greedy_threshold_and_stop_tokens():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy
    assert SamplingParams(stop_token_ids=[5, 7]).stop_token_set(2) == {2, 5, 7}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).stop_token_set(2) == {5}
    assert SamplingParams(stop_token_ids=[5]).stop_token_set(frozenset({2, 3})) == {2, 3, 5}
    assert SamplingParams().stop_token_set(None) == set()
    assert SamplingParams(repetition_penalty=1.1).has_penalties
