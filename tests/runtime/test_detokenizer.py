from functools import lru_cache

from hypothesis import given
from hypothesis import strategies as st

from tests.runtime.tiny_tokenizer import CORPUS, tiny_tokenizer_dir
from tritonllm.runtime.detokenizer import IncrementalDetokenizer, find_stop, stop_prefix_len
from tritonllm.runtime.tokenizer import Tokenizer
from tritonllm.sampling_params import SamplingParams


@lru_cache(maxsize=1)
def _tokenizer() -> Tokenizer:
    return Tokenizer(tiny_tokenizer_dir())


MULTIBYTE = ["😀", "🎉", "👍🏽", "🇯🇵", "👨‍👩‍👧", "日本語", "中文", "한국어", "é", "ñ", "ü", "Привет", "\ufffd"]
texts = st.lists(st.sampled_from(MULTIBYTE + ["a", " ", "the", "\n", ", ", "Hello"]), max_size=12).map("".join)
# Ids of every kind: any token (incl. special tokens and lone bytes that make invalid UTF-8), or a real text.
id_lists = st.one_of(
    st.lists(st.integers(0, 419), max_size=24),
    texts.map(lambda t: _tokenizer().encode(t, add_special_tokens=False)),
)


def _chunks(ids: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(points, points[1:], strict=False)]


def _stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> str:
    """Feed chunks, collecting the streamed deltas; the last chunk finishes the sequence."""
    shown = ""
    for i, chunk in enumerate(chunks):
        detok.update(chunk, finished=i == len(chunks) - 1)
        shown += detok.get_next_output_text(delta=True)
        if detok.finished:
            break
    return shown


@given(ids=id_lists, cuts=st.lists(st.integers(0, 50), max_size=6), skip=st.booleans())
def test_incremental_decode_equals_full_decode(ids, cuts, skip):
    tok = _tokenizer()
    detok = IncrementalDetokenizer(tok, SamplingParams(skip_special_tokens=skip))
    shown = _stream(detok, _chunks(ids, cuts) or [[]])
    assert shown == detok.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert detok.token_ids == ids


@given(
    ids=id_lists,
    cuts=st.lists(st.integers(0, 50), max_size=6),
    reads=st.lists(st.booleans(), max_size=8),
    skip=st.booleans(),
    prompt=id_lists,
)
def test_lazy_decode_gives_the_same_text(ids, cuts, reads, skip, prompt):
    # Lazy: nothing decoded per update, only when the text is read (at the end, or now and then).
    tok = _tokenizer()
    params = SamplingParams(skip_special_tokens=skip)
    eager = IncrementalDetokenizer(tok, params, prompt)
    lazy = IncrementalDetokenizer(tok, params, prompt, lazy=True)
    chunks = _chunks(ids, cuts) or [[]]
    shown = ""
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        eager.update(chunk, finished=last)
        assert lazy.update(chunk, finished=last) is None
        if last or (reads and reads[i % len(reads)]):
            shown += lazy.get_next_output_text(delta=True)
    assert shown == lazy.output_text == eager.get_next_output_text(finished=True)
    assert lazy.token_ids == eager.token_ids == ids


def test_lazy_is_ignored_with_stop_strings():
    tok = _tokenizer()
    ids = tok.encode("Hello, the end", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["the"]), lazy=True)
    assert not detok.lazy
    assert detok.update(ids, finished=True) == "the"
    assert detok.get_next_output_text(finished=True) == "Hello, "


@given(ids=id_lists, cuts=st.lists(st.integers(0, 50), max_size=6))
def test_text_is_held_back_only_while_a_character_is_incomplete(ids, cuts):
    tok = _tokenizer()
    detok = IncrementalDetokenizer(tok)
    seen: list[int] = []
    for chunk in _chunks(ids, cuts):
        detok.update(chunk)
        seen += chunk
        # Emitted text is final (the full decode continues it) and never ends inside a character...
        assert tok.decode(ids).startswith(detok.output_text)
        assert not detok.output_text.endswith("\ufffd")
        # ...and nothing else is held back.
        if not tok.decode(seen).endswith("\ufffd"):
            assert detok.output_text == tok.decode(seen)


@given(prompt=texts, output=texts)
def test_prompt_context_gives_the_text_that_follows_the_prompt(prompt, output):
    tok = _tokenizer()
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    output_ids = tok.encode(prompt + output, add_special_tokens=False)[len(prompt_ids) :]
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids)
    for i, t in enumerate(output_ids):
        detok.update([t], finished=i == len(output_ids) - 1)
    context = prompt_ids[-6:]
    assert detok.output_text == tok.decode(context + output_ids)[len(tok.decode(context)) :]


stop_strings = st.lists(
    st.sampled_from(["日本", "😀", "ab", "a", "\n\n", "the", "👍🏽x", "Hello"]), min_size=1, max_size=3
)
stop_texts = st.lists(st.sampled_from(MULTIBYTE + ["a", "b", "ab", "x", "the", "\n", "Hel", "lo"]), max_size=14).map(
    "".join
)


def _first_stop_reference(text: str, stops: list[str]) -> tuple[str, int] | None:
    """Read character by character; stop at the first position where some stop string has just ended."""
    for end in range(1, len(text) + 1):
        ended = [(end - len(s), s) for s in stops if text[:end].endswith(s)]
        if ended:
            start, s = min(ended)
            return s, start
    return None


@given(text=stop_texts, stops=stop_strings, cuts=st.lists(st.integers(0, 60), max_size=6), include=st.booleans())
def test_stop_strings_cut_exactly_across_chunks(text, stops, cuts, include):
    tok = _tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, params)
    shown = _stream(detok, _chunks(ids, cuts) or [[]])

    expected = _first_stop_reference(text, stops)
    if expected is None:
        assert detok.stop_reason is None and detok.output_text == text
    else:
        stop, start = expected
        assert detok.stop_reason == stop
        assert detok.output_text == text[: start + len(stop) if include else start]
    # Streaming never showed text that the stop string later removed.
    assert shown == detok.output_text


@given(text=stop_texts, stops=stop_strings, new=st.integers(0, 60))
def test_find_stop_and_hold_back(text, stops, new):
    new = min(new, len(text))
    old = text[: len(text) - new]
    if _first_stop_reference(old, stops) is not None:
        return  # the text would have stopped earlier
    found = find_stop(text, stops, new)
    assert found == _first_stop_reference(text, stops)
    held = stop_prefix_len(text, stops)
    assert all(not text.endswith(s[:n]) for s in stops for n in range(held + 1, len(s)))
    assert held == 0 or any(text.endswith(s[:held]) and held < len(s) for s in stops)


def test_stop_token_text_is_left_out_unless_asked():
    tok = _tokenizer()
    ids = tok.encode("Hello the", add_special_tokens=False)
    for include in (False, True):
        detok = IncrementalDetokenizer(tok, SamplingParams(include_stop_str_in_output=include))
        detok.update(ids[:-1])
        assert detok.update(ids[-1:], stop_terminated=True) is None
        assert detok.finished and detok.token_ids == ids
        assert detok.output_text == (tok.decode(ids) if include else tok.decode(ids[:-1]))


def test_streaming_holds_back_a_possible_stop_string():
    tok = _tokenizer()
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["the end"]))
    detok.update(tok.encode("Hello th", add_special_tokens=False))
    assert detok.get_next_output_text(delta=True) == "Hello "
    detok.update(tok.encode("e", add_special_tokens=False))
    assert detok.get_next_output_text(delta=True) == ""
    detok.update(tok.encode("m", add_special_tokens=False))
    assert detok.get_next_output_text(delta=True) == "them"
    detok.update(tok.encode(" the", add_special_tokens=False), finished=True)
    assert detok.get_next_output_text(delta=True) == " the"
    assert detok.output_text == "Hello them the" and CORPUS
