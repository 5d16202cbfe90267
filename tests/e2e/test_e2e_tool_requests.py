"""Tool-calling requests against a real `tandem serve` (the bundled tiny-shakespeare target, a
chat template that renders tools and earlier calls, --enable-auto-tool-choice, each parser):
every tool_choice / tools / history shape a vLLM user may send answers 200 or a 400 with
OpenAI's error shape naming the field, streamed or not; never a 5xx, a hang or a traceback."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from tests.e2e.api_util import stop_server
from tests.helpers.server import ROOT, Server

TARGET = os.path.join(ROOT, "models", "tiny-shakespeare", "target")
TEMPLATE = """{%- if tools %}{{- 'Tools:' }}{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}{{- '<start_of_turn>model' }}
{%- for c in m.tool_calls %}{{- '\\n<tool_call>\\n{"name": "' + c.function.name + '", "arguments": ' }}
{{- c.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<end_of_turn>\\n' }}
{%- elif m.role == 'tool' %}{{- '<start_of_turn>user\\n<tool_response>' + m.content + '</tool_response><end_of_turn>\\n' }}
{%- else %}{{- '<start_of_turn>' + m.role + '\\n' + m.content + '<end_of_turn>\\n' }}{%- endif %}
{%- endfor %}{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather?"}]


def history(arguments) -> list[dict]:
    return ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "gemma4"])
def srv(request, tmp_path_factory):
    model = tmp_path_factory.mktemp(f"tools-{request.param}")
    for name in os.listdir(TARGET):
        if name != "tokenizer_config.json":
            os.symlink(os.path.join(TARGET, name), model / name)
    with open(os.path.join(TARGET, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    s = Server(str(model), "--enable-auto-tool-choice", "--tool-call-parser", request.param)
    yield s
    stop_server(s)


OK = [
    {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}, {"tools": TOOLS, "tool_choice": "auto"},
    {"tool_choice": "none"}, {"tools": []}, {"tools": TOOLS, "n": 2}, {"tools": TOOLS, "parallel_tool_calls": False},
    {"messages": history('{"city": "Paris"}'), "tools": TOOLS}, {"messages": history({"city": "Paris"}), "tools": TOOLS},
    {"messages": history(""), "tools": TOOLS},
    {"tools": TOOLS, "tool_choice": "required"}, {"tools": TOOLS, "tool_choice": "required", "n": 2},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
]
BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": history('{"city": '), "tools": TOOLS}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": history("[" * 50000 + "]" * 50000), "tools": TOOLS}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": history([1]), "tools": TOOLS}, "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_requests_answer_200_or_a_named_400(srv, stream):
    url = srv.base_url + "/chat/completions"
    for extra in OK:
        r = httpx.post(url, json={"messages": ASK, "max_tokens": 4, "stream": stream, **extra}, timeout=60)
        assert r.status_code == 200, (extra, r.text)
        if stream:
            lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), extra
    for extra, param in BAD:
        r = httpx.post(url, json={"messages": ASK, "max_tokens": 4, "stream": stream, **extra}, timeout=60)
        assert r.status_code == 400, (param, r.text)
        err = r.json()["error"]
        assert (err["param"], err["code"], err["type"]) == (param, 400, "BadRequestError"), err
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    assert "Traceback" not in srv.output()


def test_openai_client_round_trip(srv):
    """The official client, streaming and not, n=2, greedy: a model that writes no call answers
    the same text with the same finish_reason either way."""
    client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
    kw = dict(model=client.models.list().data[0].id, messages=ASK, tools=TOOLS, max_tokens=6, n=2, temperature=0)
    full = client.chat.completions.create(**kw)
    folded = {i: ["", None, []] for i in (0, 1)}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            folded[c.index][0] += c.delta.content or ""
            folded[c.index][1] = c.finish_reason or folded[c.index][1]
            folded[c.index][2] += c.delta.tool_calls or []
    for a in full.choices:
        assert [a.message.content, a.finish_reason, a.message.tool_calls or []] == folded[a.index]
