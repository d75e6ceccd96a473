"""Text <-> token ids for a model directory, on the `tokenizers` package, plus chat templates (jinja2).

Reads tokenizer.json (required) and, when present, tokenizer_config.json (special tokens, add_bos_token /
add_eos_token, chat_template), chat_template.jinja and additional_chat_templates/*.jinja (transformers' own
files, which take priority over the config's template, as in transformers).
"""

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _HFTokenizer

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores a special token as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A model's tokenizer, loaded from a local directory.

    encode(text, add_special_tokens=True): add_special_tokens adds what the tokenizer's post-processor adds
    (typically BOS). When tokenizer_config.json sets add_bos_token or add_eos_token explicitly, those flags
    decide (as transformers 4's Llama-family tokenizers and vLLM do); otherwise tokenizer.json's post-processor
    does. Padding and truncation stored in tokenizer.json are switched off: an engine never cuts a prompt.
    decode(ids, skip_special_tokens=True) does no clean-up of tokenization spaces, like vLLM's detokenizer.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        tokenizer_file = self.path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json at {tokenizer_file}; tritonllm reads only fast-tokenizer files. Convert a "
                "slow tokenizer once with transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
            )
        self._tokenizer = _HFTokenizer.from_file(str(tokenizer_file))
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        config_file = self.path / "tokenizer_config.json"
        self.config: dict[str, Any] = (
            json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        )

        self.special_tokens: dict[str, str] = {}  # "bos_token" -> "<s>", only the ones set
        for name in SPECIAL_TOKEN_NAMES:
            content = _token_content(self.config.get(name))
            if content is not None:
                self.special_tokens[name] = content
        # Named special tokens missing from the vocab are added as special tokens, as transformers does.
        missing = [c for c in self.special_tokens.values() if self._tokenizer.token_to_id(c) is None]
        if missing:
            self._tokenizer.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in missing])
        if "add_bos_token" in self.config or "add_eos_token" in self.config:
            self._set_post_processor(bool(self.config.get("add_bos_token")), bool(self.config.get("add_eos_token")))
        self.chat_template: str | dict[str, str] | None = self._load_chat_template()

    # ---------------------------------------------------------------- special tokens
    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos, eos = self.bos_token if add_bos else None, self.eos_token if add_eos else None
        single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
        pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
        special = [(t, self._tokenizer.token_to_id(t)) for t in (bos, eos) if t]
        self._tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    @property
    def all_special_ids(self) -> set[int]:
        """Ids of every added token marked special (the ones skip_special_tokens drops)."""
        return {i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special}

    @property
    def vocab_size(self) -> int:
        """Token ids in use, added tokens included (a model's embedding may be padded beyond it)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    # ---------------------------------------------------------------- text <-> ids
    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tokenizer.id_to_token(i) for i in ids]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------- chat templates
    def _load_chat_template(self) -> str | dict[str, str] | None:
        templates: dict[str, str] = {}
        configured = self.config.get("chat_template")
        if isinstance(configured, str):
            templates["default"] = configured
        elif isinstance(configured, list):  # [{"name": ..., "template": ...}, ...]
            templates.update({t["name"]: t["template"] for t in configured})
        jinja_file = self.path / "chat_template.jinja"
        extra_files = sorted((self.path / "additional_chat_templates").glob("*.jinja"))
        if jinja_file.is_file() or extra_files:
            templates = {}  # separate files replace the config's templates, as in transformers
            if jinja_file.is_file():
                templates["default"] = jinja_file.read_text(encoding="utf-8")
            templates.update({f.stem: f.read_text(encoding="utf-8") for f in extra_files})
        if not templates:
            return None
        if list(templates) == ["default"]:
            return templates["default"]
        return templates

    def get_chat_template(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The template source: a name among the model's templates, a template string, or the model's default
        (its "tool_use" template when tools are given and it has one)."""
        if isinstance(self.chat_template, dict):
            if chat_template is not None:
                return self.chat_template.get(chat_template, chat_template)
            if tools is not None and "tool_use" in self.chat_template:
                return self.chat_template["tool_use"]
            if "default" in self.chat_template:
                return self.chat_template["default"]
            raise ValueError(
                f"{self.path} has several chat templates and none named 'default'; pass chat_template= one of "
                f"{sorted(self.chat_template)}"
            )
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ValueError(
                f"{self.path} has no chat template: add a 'chat_template' entry to tokenizer_config.json or a "
                "chat_template.jinja file to that directory, or pass chat_template='<jinja template>' here"
            )
        return self.chat_template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation ([{"role": ..., "content": ...}, ...]) the way transformers does: a sandboxed
        jinja2 environment with trim_blocks and lstrip_blocks, raise_exception, strftime_now and a tojson
        that keeps non-ASCII text; variables messages, tools, documents, add_generation_prompt, the special
        tokens (bos_token, eos_token, ...) and **kwargs. Keys whose value is None are dropped from messages.
        Returns the prompt text, or its ids (encoded without adding special tokens) when tokenize=True.
        """
        if not messages:
            raise ValueError("apply_chat_template needs at least one message")
        template = _compile(self.get_chat_template(chat_template, tools))
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = template.render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
