"""A tiny byte-level BPE tokenizer trained on the spot, for the tokenizer_proc tests.

The corpus mixes ASCII, accents, CJK and emoji so that many merges stop inside a UTF-8
character: decoding one token at a time then produces broken characters, which is what the
incremental detokenizer must handle.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "Hello world. This is a test of the emergency broadcast system.",
    "The quick brown fox jumps over the lazy dog; the dog sleeps.",
    "Stop here. STOP! stop... Stopping is hard to do, said the stopwatch.",
    "日本語のテキストと中文文本混合在一起。东京、北京、上海。",
    "Emoji: 😀😃😄😁 🚀🔥✨ 👍🏽 👨‍👩‍👧 — and accents: café naïve résumé Zürich.",
    "Numbers 0123456789 and symbols !@#$%^&*()_+-=[]{}|;':\",./<>?",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind.",
    "def f(x):\n    return x * 2\n\nprint(f(21))\n",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama-2 style: writes BOS itself, validates roles with raise_exception.
LLAMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)


def train_tokenizer(vocab_size: int = 420) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def write_tokenizer_dir(path: str, template: str | None = CHATML_TEMPLATE, add_bos: bool = True) -> str:
    """tokenizer.json (+ a BOS post-processor when add_bos) and tokenizer_config.json."""
    tok = train_tokenizer()
    if add_bos:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        # A serialised AddedToken, as older checkpoints store it.
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True, "lstrip": False,
                      "rstrip": False, "normalized": False, "single_word": False},
        "pad_token": "<pad>",
        "add_bos_token": add_bos,
        "model_max_length": 4096,
    }
    if template is not None:
        config["chat_template"] = template
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


def tokenizer_with_tags(path: str, tags: list[str], special: bool) -> str:
    """A tokenizer directory whose ``tags`` are single added tokens, marked special or not (Qwen3's
    think tags are plain added tokens; some checkpoints mark tool-call tags special)."""
    write_tokenizer_dir(path)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    (tok.add_special_tokens if special else tok.add_tokens)(tags)
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


@functools.cache
def shared_tokenizer_dir(template_name: str = "chatml") -> str:
    """One trained tokenizer directory per template, reused by every test in the session."""
    template = {"chatml": CHATML_TEMPLATE, "llama": LLAMA_TEMPLATE, "none": None}[template_name]
    return write_tokenizer_dir(tempfile.mkdtemp(prefix=f"tandem-tok-{template_name}-"), template)
