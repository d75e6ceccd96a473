"""A tiny byte-level BPE tokenizer written in the Hugging Face file format, for tokenizer tests."""

import json
import tempfile
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Multi-byte text on purpose: accents (2 bytes), CJK (3 bytes), emoji (4 bytes, some of several code points).
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world!",
    "def main():\n    return [x * 2 for x in range(10)]\n",
    "Café au lait, naïve résumé, jalapeño, Grüße aus München.",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。",
    "Emoji: 😀 😃 🎉 👍🏽 🇯🇵 👨‍👩‍👧 🚀🚀🚀 ❤️",
    "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم",
] * 20

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]

# Block tags on their own, indented lines: the output is right only with trim_blocks and lstrip_blocks.
CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
<|{{ message['role'] }}|>
    {% if message['content'] is string %}
{{ message['content'] | trim }}
    {% else %}
{{ message['content'] | tojson }}
    {% endif %}
{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""


def build_tokenizer_dir(path: Path, config_overrides: dict | None = None, post_processor: bool = True) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if post_processor:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", bos)]
        )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
        "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    config.update(config_overrides or {})
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@lru_cache(maxsize=1)
def tiny_tokenizer_dir() -> Path:
    return build_tokenizer_dir(Path(tempfile.mkdtemp(prefix="tritonllm-tok-")))
