"""Tool calling as a vLLM user drives it: earlier tool calls whose
arguments nest too deeply (a 400, never a 500), ``parallel_tool_calls=false`` (only the first
call, as vLLM), malformed ``tools`` (400s naming the field, as vLLM's request model), and the
openai client's own stream helper folding a stream back into the non-streaming answer."""

from __future__ import annotations

import json

import openai
import pytest

from tests.unit.front_harness import MODEL
from tests.unit.front_tok import shared_tokenizer_dir
from tests.unit.tool_stack import ASK, CALL, TOOLS, reset_fake, script, stack  # noqa: F401 - fixtures
from tokenizer_proc.chat_template import ChatTemplate, ChatTemplateError
from tokenizer_proc.tokenizer import TextTokenizer

TWO_CALLS = "Let me check.\n" + CALL % "Paris" + "\n" + CALL % "Tokyo"


def history(arguments) -> list[dict]:
    return ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]


# ---------------------------------------------------------------------- deep nesting


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("raw", ['{"a":' * 5000 + "1" + "}" * 5000, "[" * 100000 + "]" * 100000])
def test_arguments_nested_too_deeply_are_a_400(http, raw, stream):
    """json.loads raises RecursionError (not ValueError) on deep nesting: it was a 500."""
    body = {"messages": history(raw), "tools": TOOLS, "max_tokens": 2, "stream": stream}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[1].tool_calls[0].function.arguments" and "nested too deeply" in err["message"]
    r = http.post("/tokenize", json={"messages": history(raw)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    assert http.get("/health").status_code == 200


def test_a_template_that_recurses_is_a_template_error():
    """Rendering that runs out of stack (a deep structure through ``tojson``, a recursive
    template) is the request's 400, like the template's other failures."""
    tok = TextTokenizer(shared_tokenizer_dir("chatml"))
    tmpl = ChatTemplate("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(messages) }}", tok)
    with pytest.raises(ChatTemplateError, match="nested too deeply"):
        tmpl.render([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------- parallel_tool_calls


def fold(chunks, index: int = 0) -> tuple[str | None, list[dict], str | None]:
    """Chunks of one choice folded the way clients fold them (tool calls by index)."""
    content, calls, finish = None, {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index != index:
                continue
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tokens_per_step", [1, 40])
def test_parallel_tool_calls_false_keeps_the_first_call(stack, client, tokens_per_step):
    """vLLM (maybe_filter_parallel_tool_calls): with parallel_tool_calls false only the first
    call is returned, streamed deltas of index 0 only; true or unset returns every call."""
    stack.fake.tokens_per_step = tokens_per_step
    script(stack, TWO_CALLS)
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300, n=2)
    for parallel, want in ((False, ["Paris"]), (True, ["Paris", "Tokyo"]), (None, ["Paris", "Tokyo"])):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = client.chat.completions.create(**kw, **extra)
        chunks = list(client.chat.completions.create(stream=True, **kw, **extra))
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
            assert [json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls] == want
            content, calls, finish = fold(chunks, choice.index)
            assert (content, finish) == ("Let me check.\n", "tool_calls")
            assert [json.loads(c["arguments"])["city"] for c in calls] == want


def test_parallel_tool_calls_must_be_a_boolean(http):
    body = {"messages": ASK, "tools": TOOLS, "parallel_tool_calls": "sometimes"}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "parallel_tool_calls", r.text


# ---------------------------------------------------------------------- gemma4 bare numbers


@pytest.mark.parametrize("raw,want", [
    ("1e999", "1e999"),  # json.dumps(inf) is Infinity: not JSON
    ("-2.5e400", "-2.5e400"),
    ("9" * 5000, "9" * 5000),  # int() refuses more than 4300 digits: it raised, mid-stream too
    ("2.5e3", 2500.0),
    ("-7", -7),
])
def test_gemma4_bare_numbers_json_cannot_hold_stay_text(raw, want):
    from tests.unit.tool_parser_util import shape, sized, stream, whole

    text = "<|tool_call>call:f{a:%s,b:1}<tool_call|>" % raw
    m = whole("gemma4", text)
    assert m.content is None and len(m.tool_calls) == 1
    args = m.tool_calls[0].arguments
    assert json.loads(args, parse_constant=lambda c: pytest.fail(f"not JSON: {c}")) == {"a": want, "b": 1}
    for sizes in ([1], [7], [len(text)]):
        got, _, broken = stream("gemma4", sized(text, sizes))
        assert not broken and shape(got) == shape(m)


# ---------------------------------------------------------------------- malformed tools


@pytest.mark.parametrize("tool,param", [
    ({"type": "function"}, "tools[0].function"),
    ({"type": "function", "function": "get_weather"}, "tools[0].function"),
    ({"type": "function", "function": {"parameters": {}}}, "tools[0].function.name"),
    ({"type": "function", "function": {"name": 5}}, "tools[0].function.name"),
    ({"type": "function", "function": {"name": "f", "parameters": "a schema"}}, "tools[0].function.parameters"),
    ({"type": "function", "function": {"name": "f", "description": ["x"]}}, "tools[0].function.description"),
    ({"type": "code_interpreter"}, "tools[0].type"),
])
@pytest.mark.parametrize("tool_choice", [None, "none", "auto"])
def test_malformed_tools_are_a_400(http, tool, param, tool_choice):
    """vLLM's request model (ChatCompletionToolsParam / FunctionDefinition) refuses these with
    a 400; they were accepted and went to the chat template as they were."""
    body = {"messages": ASK, "tools": [TOOLS[0], tool], "max_tokens": 2}
    if tool_choice:
        body["tool_choice"] = tool_choice
    r = http.post("/v1/chat/completions", json=body)
    want = param.replace("tools[0]", "tools[1]")
    assert r.status_code == 400 and r.json()["error"]["param"] == want, r.text


def test_well_formed_tool_variants_are_accepted(stack, client):
    """``type`` defaults to "function"; description, strict and null parameters are fine."""
    script(stack, "It is sunny.")
    tools = [{"function": {"name": "a"}}, {"type": "function", "function": {"name": "b", "parameters": None,
                                                                             "description": "d", "strict": True}}]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, max_tokens=20)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------- the openai stream helper


@pytest.mark.parametrize("tokens_per_step", [1, 4])
def test_openai_stream_helper_rebuilds_the_non_streaming_answer(stack, client, tokens_per_step):
    """``client.beta.chat.completions.stream`` merges deltas with its own rules (``index`` and
    ``type`` replaced, other strings concatenated: an ``id`` or ``name`` sent twice would be
    doubled); its final completion equals the non-streaming answer, for every choice."""
    stack.fake.tokens_per_step = tokens_per_step
    script(stack, TWO_CALLS + "\n")
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300, n=2)
    full = client.chat.completions.create(**kw)
    with client.beta.chat.completions.stream(**kw) as s:
        done_events = [e for e in s if e.type == "tool_calls.function.arguments.done"]
        final = s.get_final_completion()
    assert len(done_events) == 4 and {json.loads(e.arguments)["city"] for e in done_events} == {"Paris", "Tokyo"}
    for got, want in zip(sorted(final.choices, key=lambda c: c.index), full.choices):
        assert (got.finish_reason, got.message.content) == (want.finish_reason, want.message.content) == (
            "tool_calls", "Let me check.\n")
        assert [(c.type, c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
            (c.type, c.function.name, c.function.arguments) for c in want.message.tool_calls]
        assert all(c.id.startswith("chatcmpl-tool-") and len(c.id) == len("chatcmpl-tool-") + 32
                   for c in got.message.tool_calls)
