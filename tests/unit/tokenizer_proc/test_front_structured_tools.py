"""Forced tool calls (tokenizer_proc/tool_choice.py): ``tool_choice: "required"`` and a named
function become grammars the engine receives, and the constrained answer becomes ``tool_calls``,
streamed and not, without the need of a --tool-call-parser (the module's stack has hermes for
"auto"; test_front_api_compat.py checks a server without the flags). The parsers on their own:
every cut of the text streams to the non-streaming answer."""

from __future__ import annotations

import functools
import json

import pytest

from proto.messages import GenerateReq
from tests.unit.front_harness import MODEL
from tests.unit.tool_parser_util import assert_split_invariant, shape, stream, whole
from tests.unit.tool_stack import ASK, TOOLS, accumulate_stream, reset_fake, script, stack  # noqa: F401 - fixtures
from tokenizer_proc.tool_parsers.forced import NamedCallParser, RequiredCallsParser

WEATHER = TOOLS[0]["function"]
TIME = {"name": "get_time", "description": "Local time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}
TWO_TOOLS = [*TOOLS, {"type": "function", "function": TIME}]
NO_PARAMS = [{"type": "function", "function": {"name": "ping"}}]
ANSWER = ('[{"name": "get_weather", "parameters": {"city": "東京 😀"}}, '
          '{"name": "get_time", "parameters": {"tz": "CET"}}]')


def item(function: dict) -> dict:
    return {"properties": {"name": {"type": "string", "enum": [function["name"]]},
                           "parameters": function.get("parameters", {"type": "object", "properties": {}})},
            "required": ["name", "parameters"]}


def grammar(stack) -> tuple[str, object]:
    g = stack.fake.of_type(GenerateReq)[-1].params.grammar
    return g.kind, json.loads(g.text)


def chat(client, **kw):
    kw.setdefault("tools", TWO_TOOLS)
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model=MODEL, messages=ASK, **kw)


@pytest.mark.parametrize("parallel,extra", [(None, {}), (True, {}), (False, {"maxItems": 1})])
def test_required_is_a_grammar_over_every_tool(stack, client, parallel, extra):
    script(stack, ANSWER)
    kw = {} if parallel is None else {"parallel_tool_calls": parallel}
    chat(client, tool_choice="required", **kw)
    assert grammar(stack) == ("json", {"type": "array", "minItems": 1, **extra,
                                       "items": {"type": "object", "anyOf": [item(WEATHER), item(TIME)]}})


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_structured_outputs_options_bind_a_forced_call(stack, client, choice):
    """vLLM merges the tools' schema into ``structured_outputs``: ``disable_any_whitespace``
    gives the forced call fixed separators too (without it the bundled model ran on in
    whitespace inside the call's JSON)."""
    script(stack, ANSWER if choice == "required" else '{"tz": "CET"}')
    chat(client, tool_choice=choice, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert stack.fake.of_type(GenerateReq)[-1].params.grammar.any_whitespace is False
    chat(client, tool_choice=choice)
    assert stack.fake.of_type(GenerateReq)[-1].params.grammar.any_whitespace is True


def test_required_answer_is_tool_calls(stack, client):
    script(stack, ANSWER)
    choice = chat(client, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    # the arguments are the model's own JSON text of "parameters"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "東京 😀"}'), ("get_time", '{"tz": "CET"}')]
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in calls)
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize("choice,text", [
    ("required", ANSWER),
    ("required", '\n[ {"name":"get_time","parameters":{"tz":"UTC"}} ]\n'),
    ({"type": "function", "function": {"name": "get_time"}}, '{"tz": "Europe/Paris", "n": [1, 2.5e3, "x\\"y"]}'),
])
@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_stream_folds_into_the_non_streaming_answer(stack, client, choice, text, tokens_per_step):
    stack.fake.tokens_per_step = tokens_per_step
    script(stack, text)
    full = chat(client, tool_choice=choice).choices[0]
    chunks = list(chat(client, tool_choice=choice, stream=True))
    content, calls, finish = accumulate_stream(chunks)
    assert (content, finish) == (full.message.content, full.finish_reason)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in full.message.tool_calls]
    assert calls and all(json.loads(c["arguments"]) for c in calls)
    if tokens_per_step == 1:  # arguments arrive as they are generated, not in one piece at the end
        assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 2


def test_named_function_answer_is_its_arguments(stack, client):
    script(stack, '{"tz": "CET"}')
    choice = chat(client, tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert grammar(stack) == ("json", TIME["parameters"])
    # finish_reason stays "stop" for a named choice (OpenAI's and vLLM's)
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments, call.type) == ("get_time", '{"tz": "CET"}', "function")
    assert call.id.startswith("chatcmpl-tool-")


def test_tools_without_parameters_take_any_object(stack, client):
    script(stack, "{}")
    chat(client, tools=NO_PARAMS, tool_choice={"type": "function", "function": {"name": "ping"}})
    assert grammar(stack) == ("json", {"type": "object", "properties": {}})
    script(stack, '[{"name": "ping", "parameters": {}}]')
    r = chat(client, tools=NO_PARAMS, tool_choice="required").choices[0]
    assert grammar(stack)[1]["items"]["anyOf"] == [item(NO_PARAMS[0]["function"])]
    assert [(c.function.name, c.function.arguments) for c in r.message.tool_calls] == [("ping", "{}")]


def test_required_moves_definitions_to_the_root(stack, client, http):
    """A tool's "#/$defs/X" refs must still resolve once its schema sits inside the array."""
    city = {"type": "string", "minLength": 1}
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"c": {"$ref": "#/$defs/City"}}, "$defs": {"City": city}}}}
        for n in ("a", "b")]
    script(stack, '[{"name": "a", "parameters": {"c": "x"}}]')
    chat(client, tools=tools, tool_choice="required")
    _, schema = grammar(stack)
    assert schema["$defs"] == {"City": city}
    assert all("$defs" not in i["properties"]["parameters"] for i in schema["items"]["anyOf"])
    assert "$defs" in tools[0]["function"]["parameters"]  # the request's own tools are untouched
    # a name that two tools define differently cannot share the root
    tools[1]["function"]["parameters"]["$defs"] = {"City": {"type": "integer"}}
    r = http.post("/v1/chat/completions", json={"messages": ASK, "tools": tools, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "Tool definition 'City' has multiple schemas, which is not supported.", "type": "BadRequestError",
        "param": "tools[1].function.parameters.$defs", "code": 400}


def test_every_choice_parses_its_own_calls(stack, client):
    script(stack, ANSWER)
    r = chat(client, tool_choice="required", n=2)
    assert [g.params.grammar for g in stack.fake.of_type(GenerateReq)[-2:]] == [
        stack.fake.of_type(GenerateReq)[-1].params.grammar] * 2
    for choice in r.choices:
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]


def test_answer_cut_short(stack, client):
    """The length cap inside the first call: no call, the text is content (streamed: the call was
    announced, so the stream keeps it, as for the auto parsers)."""
    script(stack, ANSWER)
    r = chat(client, tool_choice="required", max_tokens=8).choices[0]
    assert r.finish_reason == "length" and not r.message.tool_calls
    assert ANSWER.startswith(r.message.content)
    named = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=3)
    assert named.choices[0].finish_reason == "length" and len(named.choices[0].message.tool_calls) == 1


BAD_CHOICES = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
     "Tool 'nope' has not been passed in `tools`."),
    ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name",
     'A named tool_choice needs \'function.name\', a string: {"type": "function", "function": {"name": ...}}.'),
    ({"tool_choice": {"type": "function"}}, "tool_choice.function.name",
     'A named tool_choice needs \'function.name\', a string: {"type": "function", "function": {"name": ...}}.'),
    ({"tool_choice": {"type": "custom", "custom": {"name": "x"}}}, "tool_choice.type",
     "Invalid value for 'tool_choice.type': expected 'function', got 'custom'."),
    ({"tool_choice": "required", "tools": []}, "tool_choice", 'tool_choice "required" needs at least one tool in '
     "`tools`."),
    ({"tool_choice": "required", "tools": None}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "Only one structured-output constraint may be set per request, but both 'response_format' and "
     "'tool_choice' constrain the output."),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "guided_regex": "a"}, "tool_choice",
     "Only one structured-output constraint may be set per request, but both 'guided_regex' and "
     "'tool_choice' constrain the output."),
]


@pytest.mark.parametrize("body,param,message", BAD_CHOICES, ids=[str(b)[:60] for b, _, _ in BAD_CHOICES])
def test_bad_forced_choices_are_a_400(http, body, param, message):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "tools": TWO_TOOLS, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": message, "type": "BadRequestError", "param": param, "code": 400}


# ---------------------------------------------------------------------- the parsers alone

REQUIRED_TEXTS = [
    ANSWER,
    ' [\n  {"name": "f", "parameters": {"a": [1, {"b": null}], "s": "x, ]} y"}} ,\n'
    ' {"name": "g", "parameters": {}}\n] ',
    '[{"parameters": {"k": -0.5e+2}, "name": "h"}]',
]


@pytest.mark.parametrize("text", REQUIRED_TEXTS)
def test_required_parser_any_cut(text):
    parsed = assert_split_invariant(RequiredCallsParser, text)
    want = json.loads(text)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [(w["name"], w["parameters"])
                                                                              for w in want]


def test_named_parser_any_cut():
    text = '{"tz": "CET", "list": [1, 2], "s": "東京"}'
    parsed = assert_split_invariant(functools.partial(NamedCallParser, "get_time"), text)
    assert shape(parsed) == (None, [("get_time", text)])
    assert shape(whole(functools.partial(NamedCallParser, "f"), "")) == (None, [("f", "")])


@pytest.mark.parametrize("text,content,names", [
    ("plain text", "plain text", []),  # what only an unconstrained model writes
    ('{"name": "f", "parameters": {}}', '{"name": "f", "parameters": {}}', []),  # not an array
    ('[{"name": "f", "parameters": {}}] and more', "and more", ["f"]),
    ('[{"name": "f", "parameters": {}}, oops', ", oops", ["f"]),
    ("[]", "[]", []),
])
def test_required_parser_text_that_is_not_calls(text, content, names):
    got = whole(RequiredCallsParser, text)
    assert (got.content, [c.name for c in got.tool_calls]) == (content, names)
    streamed, _, _ = stream(RequiredCallsParser, list(text))
    assert shape(streamed) == shape(got)
