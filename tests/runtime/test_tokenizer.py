import json
from functools import lru_cache

import jinja2
import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from tests.runtime.tiny_tokenizer import CORPUS, build_tokenizer_dir, tiny_tokenizer_dir
from tritonllm.runtime.tokenizer import Tokenizer

# Any text UTF-8 can carry (no lone surrogates), biased towards multi-byte characters.
texts = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=40),
    st.lists(st.sampled_from(list("".join(CORPUS[:6])) + ["<s>", "</s>", "<|user|>"]), max_size=40).map("".join),
)
contents = st.one_of(texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2))
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": contents}),
    min_size=1,
    max_size=4,
)


@lru_cache(maxsize=1)
def _pair() -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    path = tiny_tokenizer_dir()
    return Tokenizer(path), PreTrainedTokenizerFast.from_pretrained(str(path))


@given(text=texts)
def test_encode_decode_round_trip_and_match_transformers(text):
    ours, theirs = _pair()
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ids[0] == ours.bos_token_id
    plain = ours.encode(text, add_special_tokens=False)
    assert plain == theirs.encode(text, add_special_tokens=False) == ids[1:]
    assert ours.decode(plain, skip_special_tokens=False) == text
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )


@given(ids=st.lists(st.integers(0, 419), max_size=30))
def test_decode_of_any_ids_matches_transformers(ids):
    ours, theirs = _pair()
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )


def test_special_tokens():
    ours, theirs = _pair()
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<s>", "</s>", "<pad>")
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (0, 1, 2)
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.all_special_ids == set(theirs.all_special_ids) | {3, 4, 5}
    assert ours.vocab_size == len(ours) == len(theirs) == 420
    ids = ours.encode("hi</s><|user|>")
    assert ours.convert_ids_to_tokens(ids[-2:]) == ["</s>", "<|user|>"]
    assert ours.decode(ids) == "hi"
    assert ours.decode(ids, skip_special_tokens=False) == "<s>hi</s><|user|>"


def test_add_bos_and_eos_flags(tmp_path):
    no_bos = Tokenizer(build_tokenizer_dir(tmp_path / "a", {"add_bos_token": False, "add_eos_token": True}))
    ids = no_bos.encode("hello")
    assert ids[0] != no_bos.bos_token_id and ids[-1] == no_bos.eos_token_id
    assert no_bos.encode("hello", add_special_tokens=False) == ids[:-1]
    bos = Tokenizer(build_tokenizer_dir(tmp_path / "b", {"add_bos_token": True}, post_processor=False))
    assert bos.encode("hello")[0] == bos.bos_token_id
    bare = Tokenizer(build_tokenizer_dir(tmp_path / "c", post_processor=False))
    assert bare.encode("hello") == bare.encode("hello", add_special_tokens=False)
    # A named special token missing from tokenizer.json is added as a special token.
    extra = Tokenizer(build_tokenizer_dir(tmp_path / "d", {"eos_token": "<|end|>"}))
    assert extra.eos_token_id == 420 and extra.eos_token_id in extra.all_special_ids
    assert extra.encode("a<|end|>", add_special_tokens=False)[-1] == 420


@given(conversation=messages, add_generation_prompt=st.booleans())
def test_chat_template_matches_transformers(conversation, add_generation_prompt):
    ours, theirs = _pair()
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    expected = theirs.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == expected
    ids = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == ours.encode(text, add_special_tokens=False)
    assert ids == theirs.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )


def test_chat_template_environment():
    ours, _ = _pair()
    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    # None-valued keys are dropped; tojson keeps non-ASCII and HTML characters; kwargs reach the template.
    template = "{{ messages[0] | tojson }}|{{ greeting }}|{{ eos_token }}{% generation %}ok{% endgeneration %}"
    rendered = ours.apply_chat_template(
        [{"role": "user", "content": "<b>日本</b>", "name": None}], chat_template=template, greeting="hé"
    )
    assert rendered == json.dumps({"role": "user", "content": "<b>日本</b>"}, ensure_ascii=False) + "|hé|</s>ok"
    # The sandbox refuses access to Python internals.
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ messages.__class__.__mro__ }}")


def test_named_templates_and_template_files(tmp_path):
    named = [{"name": "default", "template": "D{{ messages | length }}"}, {"name": "tool_use", "template": "T"}]
    tok = Tokenizer(build_tokenizer_dir(tmp_path / "a", {"chat_template": named}))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "D1"
    assert tok.apply_chat_template(msgs, tools=[{"name": "f"}]) == "T"
    assert tok.apply_chat_template(msgs, chat_template="tool_use") == "T"
    assert tok.apply_chat_template(msgs, chat_template="X{{ add_generation_prompt }}") == "XTrue"
    path = build_tokenizer_dir(tmp_path / "b")
    (path / "chat_template.jinja").write_text("J{{ bos_token }}", encoding="utf-8")
    assert Tokenizer(path).apply_chat_template(msgs) == "J<s>"
    assert Tokenizer(path).apply_chat_template(msgs) == PreTrainedTokenizerFast.from_pretrained(
        str(path)
    ).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer(tmp_path)
    path = build_tokenizer_dir(tmp_path / "no_template", {"chat_template": None})
    with pytest.raises(ValueError, match="no chat template.*chat_template"):
        Tokenizer(path).apply_chat_template([{"role": "user", "content": "hi"}])
