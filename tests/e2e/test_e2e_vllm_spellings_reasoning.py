"""A real `tandem serve QWEN3_DIR` started with vLLM's spellings in their `=` form and
--reasoning-parser qwen3 + hermes tool calls, driven by the official openai client: n > 1
streamed and not, logprobs beside reasoning, tools with reasoning, enable_thinking false, and bad
values for the new request fields answered 400 in the OpenAI error shape."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.api_util import stop_server
from tests.helpers.server import Server

ASK = [{"role": "user", "content": "The quick brown fox"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
KW = {"max_tokens": 6, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def srv(ckpts):
    s = Server(None, ckpts["qwen3"], "--reasoning-parser=qwen3", "--enable-auto-tool-choice",
               "--tool-call-parser=hermes", "--max-model-len=256", "--max-num-seqs=4", "--enforce-eager",
               "--seed=1", "--block-size=16", "--trust-request-chat-template")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(srv):
    return OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)


def extra(obj) -> dict:
    return obj.model_extra or {}


def fold(stream) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            o = out.setdefault(c.index, {"reasoning": "", "content": "", "finish": None, "lp": 0, "first": None})
            d = c.delta
            if o["first"] is None:
                o["first"] = d.role
            r = extra(d).get("reasoning_content")
            assert r == extra(d).get("reasoning")
            o["reasoning"] += r or ""
            o["content"] += d.content or ""
            o["lp"] += len(c.logprobs.content or []) if c.logprobs else 0
            o["finish"] = c.finish_reason or o["finish"]
    return out


def test_n2_stream_matches_non_stream_with_logprobs(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=ASK, n=2, logprobs=True, top_logprobs=2, **KW)
    assert len(r.choices) == 2 and r.usage.completion_tokens == 12
    for c in r.choices:
        # qwen3 starts in reasoning; 6 tokens without </think> are all reasoning
        assert extra(c.message)["reasoning_content"] == extra(c.message)["reasoning"]
        assert extra(c.message)["reasoning_content"] and c.message.content is None
        assert len(c.logprobs.content) == 6 and c.finish_reason == "length"
    s = fold(client.chat.completions.create(model=model, messages=ASK, n=2, stream=True, logprobs=True,
                                            top_logprobs=2, **KW))
    for c in r.choices:
        got = s[c.index]
        assert got["first"] == "assistant" and got["lp"] == 6 and got["finish"] == "length"
        assert got["reasoning"] == extra(c.message)["reasoning_content"] and got["content"] == ""


def test_enable_thinking_false_and_tools(client):
    model = client.models.list().data[0].id
    body = {**KW["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=6, temperature=0.0,
                                       extra_body=body)
    m = r.choices[0].message
    assert m.content and extra(m).get("reasoning_content") is None
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, stream=True, max_tokens=6,
                                       temperature=0.0, extra_body=body)
    assert fold(r)[0]["content"] == m.content


def test_include_reasoning_false(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=6, temperature=0.0,
                                       extra_body={"ignore_eos": True, "include_reasoning": False})
    m = r.choices[0].message
    assert m.content is None and not extra(m).get("reasoning_content")
    got = fold(client.chat.completions.create(model=model, messages=ASK, stream=True, max_tokens=6, temperature=0.0,
                                              extra_body={"ignore_eos": True, "include_reasoning": False}))
    assert got[0]["reasoning"] == "" and got[0]["content"] == "" and got[0]["finish"] == "length"


@pytest.mark.parametrize("body", [
    {"include_reasoning": "no"}, {"separate_reasoning": "no"}, {"chat_template_kwargs": "x"},
    {"chat_template": 3}, {"chat_template": "{{ x"}, {"chat_template": "{{ 1/0 }}"},
    {"chat_template_kwargs": {"chat_template": ["x"]}},
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_new_fields_are_400(srv, client, body, stream):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=2, stream=stream, extra_body=body)
    assert exc.value.status_code == 400
    r = httpx.post(srv.base_url + "/chat/completions",
                   json={"model": model, "messages": ASK, "max_tokens": 2, "stream": stream, **body}, timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param", "code"}


def test_all_reasoning_answer_back_as_history(client):
    """The openai client's usual multi-turn loop: the answer (content null, all reasoning after a
    length cut) appended to the history, then the next turn."""
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=ASK, **KW)
    answer = r.choices[0].message
    assert answer.content is None and extra(answer)["reasoning_content"]
    history = [*ASK, answer.model_dump(), {"role": "user", "content": "and then?"}]
    again = client.chat.completions.create(model=model, messages=history, **KW)
    assert again.choices[0].finish_reason == "length"


def test_max_model_len_human_readable(ckpts):
    s = Server(None, ckpts["qwen3"], "--max-model-len=1k", "--allow-long-context-length", "--reasoning-parser", "deepseek-r1",
               "--enforce-eager")
    try:
        assert httpx.get(s.base_url + "/models", timeout=30).json()["data"][0]["max_model_len"] == 1000
    finally:
        stop_server(s)
