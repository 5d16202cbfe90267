"""Chat template rendering compared with transformers' apply_chat_template."""

from __future__ import annotations

import json
import os

import pytest

from tests.unit.front_tok import CHATML_TEMPLATE, shared_tokenizer_dir, write_tokenizer_dir
from tokenizer_proc.chat_template import ChatTemplate, ChatTemplateError
from tokenizer_proc.tokenizer import TextTokenizer

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "Hello 😀 there"}],
    [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! 日本語"},
        {"role": "user", "content": "  café?  "},
    ],
]


def ours(tok_dir: str, messages, add_generation_prompt: bool):
    tok = TextTokenizer(tok_dir)
    text = ChatTemplate.from_tokenizer(tok).render(messages, add_generation_prompt=add_generation_prompt)
    return text, tok.encode(text, add_special_tokens=False)


def theirs(tok_dir: str, messages, add_generation_prompt: bool):
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return text, list(ids)


@pytest.mark.parametrize("template", ["chatml", "llama"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_matches_transformers(template, conv, gen_prompt):
    tok_dir = shared_tokenizer_dir(template)
    messages = CONVERSATIONS[conv]
    assert ours(tok_dir, messages, gen_prompt) == theirs(tok_dir, messages, gen_prompt)


def test_bos_written_by_template_is_not_doubled():
    tok_dir = shared_tokenizer_dir("llama")
    _, ids = ours(tok_dir, CONVERSATIONS[0], True)
    tok = TextTokenizer(tok_dir)
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id
    assert tok.encode("x")[0] == tok.bos_id  # plain prompts still get their BOS


def test_raise_exception_becomes_template_error():
    tok = TextTokenizer(shared_tokenizer_dir("llama"))
    bad = [{"role": "assistant", "content": "first"}]
    with pytest.raises(ChatTemplateError, match="alternate"):
        ChatTemplate.from_tokenizer(tok).render(bad)


def test_text_parts_are_flattened():
    tok = TextTokenizer(shared_tokenizer_dir("chatml"))
    tmpl = ChatTemplate.from_tokenizer(tok)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tmpl.render(parts) == tmpl.render([{"role": "user", "content": "a\nb"}])
    with pytest.raises(ChatTemplateError):
        tmpl.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_none_values_are_dropped():
    tok = TextTokenizer(shared_tokenizer_dir("chatml"))
    src = "{% for m in messages %}{{ m.get('name', 'anon') }}{% endfor %}"
    assert ChatTemplate(src, tok).render([{"role": "user", "content": "x", "name": None}]) == "anon"


def test_fallback_template_writes_bos_once():
    tok_dir = shared_tokenizer_dir("none")
    tok = TextTokenizer(tok_dir)
    tmpl = ChatTemplate.from_tokenizer(tok)
    assert tmpl.is_fallback
    text = tmpl.render([{"role": "user", "content": "hi"}])
    assert text == "<s>user: hi\nassistant:"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_id) == 1


def test_template_file_precedence(tmp_path):
    tok_dir = write_tokenizer_dir(str(tmp_path / "t"), template="CONFIG")
    tok = TextTokenizer(tok_dir)
    assert ChatTemplate.from_tokenizer(tok).render([{"role": "user", "content": "x"}]) == "CONFIG"
    with open(os.path.join(tok_dir, "chat_template.json"), "w") as f:
        json.dump({"chat_template": "JSON"}, f)
    assert ChatTemplate.from_tokenizer(tok).render([{"role": "user", "content": "x"}]) == "JSON"
    with open(os.path.join(tok_dir, "chat_template.jinja"), "w") as f:
        f.write("JINJA")
    assert ChatTemplate.from_tokenizer(tok).render([{"role": "user", "content": "x"}]) == "JINJA"


def test_named_templates_pick_default(tmp_path):
    tok_dir = write_tokenizer_dir(str(tmp_path / "t"), template=None)
    cfg_path = os.path.join(tok_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": CHATML_TEMPLATE}]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    tok = TextTokenizer(tok_dir)
    out = ChatTemplate.from_tokenizer(tok).render([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert out == "<|im_start|>user\nx<|im_end|>\n"


def test_sandbox_blocks_attribute_escapes():
    tok = TextTokenizer(shared_tokenizer_dir("chatml"))
    evil = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(evil, tok).render([{"role": "user", "content": "x"}])


PREFILLS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Well, 日本"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  padded answer  "}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "part"}]}],
]


@pytest.mark.parametrize("template", ["chatml", "llama"])
@pytest.mark.parametrize("conv", range(len(PREFILLS)))
def test_continue_final_message_matches_transformers(template, conv):
    """vLLM's continue_final_message: the last (assistant) turn is left open for the model to
    continue, cut exactly where HF's apply_chat_template cuts it."""
    tok_dir = shared_tokenizer_dir(template)
    tok = TextTokenizer(tok_dir)
    messages = PREFILLS[conv]
    ours_text = ChatTemplate.from_tokenizer(tok).render(messages, add_generation_prompt=False,
                                                        continue_final_message=True)
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    flat = [{**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][-1]["text"]}
            for m in messages]  # these templates only print string content (ours flattens parts first)
    theirs_text = hf.apply_chat_template(flat, tokenize=False, add_generation_prompt=False,
                                         continue_final_message=True)
    assert ours_text == theirs_text
    assert not ours_text.rstrip().endswith(("<|im_end|>", "[/INST]", "</s>"))


def test_continue_final_message_errors():
    tmpl = ChatTemplate.from_tokenizer(TextTokenizer(shared_tokenizer_dir("chatml")))
    messages = PREFILLS[0]
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        tmpl.render(messages, add_generation_prompt=True, continue_final_message=True)
    hiding = ChatTemplate("{% for m in messages %}[{{ m['role'] }}]{% endfor %}", TextTokenizer(
        shared_tokenizer_dir("chatml")))
    with pytest.raises(ChatTemplateError, match="does not appear"):
        hiding.render(messages, add_generation_prompt=False, continue_final_message=True)
