"""A real `tandem serve` started with a vLLM user's command line (positional MODEL,
--max-model-len, --max-num-seqs, --enforce-eager, --seed) plus --chat-template FILE,
--trust-request-chat-template and --reasoning-parser deepseek_r1, checked with the official
openai client: the file's template renders the prompt, a request's own template replaces it,
and the reasoning parser splits the greedy answer, which /v1/completions (never parsed) gives
for the same prompt tokens."""

from __future__ import annotations

import os

import pytest
from openai import OpenAI
from tokenizers import Tokenizer

from tests.e2e.api_util import stop_server
from tests.helpers.server import Server

FILE_TEMPLATE = ("{{ bos_token }}[file]{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
                 "<|assistant|>")
REQUEST_TEMPLATE = "{{ bos_token }}[request]<|user|>{{ messages[-1]['content'] }}<|end|><|assistant|></think>"
ASK = [{"role": "user", "content": "The quick brown fox"}]
GREEDY = {"temperature": 0.0, "max_tokens": 8}


@pytest.fixture(scope="module")
def srv(ckpts, tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text(FILE_TEMPLATE)
    s = Server(None, ckpts["llama"], "--chat-template", str(path), "--trust-request-chat-template",
               "--reasoning-parser", "deepseek_r1", "--max-model-len", "256", "--max-num-seqs", "4",
               "--enforce-eager", "--seed", "1")
    yield s, Tokenizer.from_file(os.path.join(ckpts["llama"], "tokenizer.json"))
    stop_server(s)


def prompt_ids(tok: Tokenizer, template_text: str) -> list[int]:
    return tok.encode(template_text, add_special_tokens=False).ids


def completion_text(client: OpenAI, ids: list[int]) -> str:
    r = client.completions.create(model=client.models.list().data[0].id, prompt=ids, extra_body={"ignore_eos": True},
                                  **GREEDY)
    assert r.choices[0].finish_reason == "length"
    return r.choices[0].text


def test_file_template_and_reasoning(srv):
    s, tok = srv
    client = OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    ids = prompt_ids(tok, "<s>[file]<|user|>The quick brown fox<|end|><|assistant|>")
    want = completion_text(client, ids)
    assert want and "</think>" not in want
    r = client.chat.completions.create(model=model, messages=ASK, extra_body={"ignore_eos": True}, **GREEDY)
    choice = r.choices[0]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    # deepseek_r1 starts in reasoning: an answer that never closed the block is all reasoning
    assert choice.message.model_extra["reasoning_content"] == choice.message.model_extra["reasoning"] == want
    assert choice.message.content is None and choice.finish_reason == "length"
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in client.chat.completions.create(model=model, messages=ASK, stream=True,
                                                                extra_body={"ignore_eos": True}, **GREEDY)
                        if c.choices)
    assert reasoning == want


def test_request_template_closing_the_block(srv):
    s, tok = srv
    client = OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    ids = prompt_ids(tok, "<s>[request]<|user|>The quick brown fox<|end|><|assistant|></think>")
    want = completion_text(client, ids)
    assert want
    r = client.chat.completions.create(model=model, messages=ASK, **GREEDY,
                                       extra_body={"ignore_eos": True, "chat_template": REQUEST_TEMPLATE})
    choice = r.choices[0]
    assert r.usage.prompt_tokens == len(ids)
    # the template ended the prompt with </think>: the whole answer is content
    assert choice.message.content == want and choice.message.model_extra["reasoning_content"] is None
