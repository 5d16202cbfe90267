"""Tool-call parsers (hermes, llama3_json): complete answers, several calls, content around
them, malformed calls as content, and the stream equal to the whole answer however the text
is cut (every split point, one character at a time, random chunk sizes)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.parsers import TOOL_CALL_PARSERS
from tests.unit.tool_parser_util import assert_split_invariant, shape, sized, stream, whole
from tokenizer_proc.tool_parsers import parser_class

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2.5e3, true, null]}}'


def hermes(call: str, sep: str = "\n") -> str:
    return f"<tool_call>{sep}{call}{sep}</tool_call>"


def test_every_registered_name_loads_its_parser():
    for name in TOOL_CALL_PARSERS:
        assert parser_class(name).name == name
    assert parser_class("hermes").keeps_special_tokens and not parser_class("llama3_json").keeps_special_tokens


# ---------------------------------------------------------------------- hermes


def test_hermes_one_call_no_content():
    m = assert_split_invariant("hermes", hermes(WEATHER), three_way=True)
    assert shape(m) == (None, [("get_weather", '{"city": "Paris", "days": [1, 2.5e3, true, null]}')])


def test_hermes_content_before_and_several_calls():
    text = "Let me check both.\n\n" + hermes(WEATHER) + "\n" + hermes('{"arguments": {}, "name": "now"}') + "\n"
    m = assert_split_invariant("hermes", text)
    assert m.content == "Let me check both.\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2500.0, True, None]}), ("now", {})]
    assert len({c.id for c in m.tool_calls}) == 2


def test_hermes_text_between_and_after_calls_is_content():
    text = hermes(WEATHER) + "\nand then\n" + hermes('{"name": "b", "arguments": {"x": "</tool_call>"}}') + " done."
    m = assert_split_invariant("hermes", text)
    assert m.content == "\nand then\n done."
    assert json.loads(m.tool_calls[1].arguments) == {"x": "</tool_call>"}  # a tag inside a string is data


@pytest.mark.parametrize("text", [
    "Plain answer, no calls.\n", "\n\n", "", "a <tool hm <tools> <tool_call", "x </tool_call> y", "<tool_cal",
])
def test_hermes_without_calls_returns_the_text_exactly(text):
    m = assert_split_invariant("hermes", text)
    assert m.content == text and m.tool_calls == []


@pytest.mark.parametrize("call", [
    '{"name": 5, "arguments": {}}', "not json", '{"arguments": {"a": 1}}', "{'name': 'f', 'arguments': {}}",
    '{"name": "", "arguments": {}}', '{"name": "f"', '{"name": "f" "arguments": {}}',
])
def test_hermes_malformed_call_is_content(call):
    """A call that fails before it could be announced: its text, tags included, is content."""
    text = "Before " + hermes(call) + " after"
    m = assert_split_invariant("hermes", text)
    assert m.content == text and m.tool_calls == []


def test_hermes_a_malformed_call_next_to_a_good_one():
    text = hermes("oops") + hermes(WEATHER)
    m = assert_split_invariant("hermes", text)
    assert m.content == hermes("oops") and [c.name for c in m.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("text", [
    hermes('{"name": "f", "arguments": {"a": 1,}}'),  # breaks after the call was announced
    '<tool_call>\n{"name": "f", "arguments": {"city": "Par',  # cut off by max_tokens
])
def test_hermes_call_broken_mid_stream(text):
    """Non-streaming: the broken call is dropped and its text is content. Streaming cannot take
    the announced call back: it keeps what it sent and the rest is content."""
    m = whole("hermes", text)
    assert m.content == text and m.tool_calls == []
    streamed, _, broken = stream("hermes", list(text))
    assert broken and streamed.tool_calls[0].name == "f"
    args_start = text.index("{", text.index("arguments"))
    assert streamed.tool_calls[0].arguments + (streamed.content or "") == text[args_start:]
    duplicate = hermes('{"name": "f", "arguments": {}, "name": "g"}')
    assert shape(whole("hermes", duplicate)) == (duplicate, [])


def test_hermes_leniencies():
    """No end tag (the model stopped right after the JSON), no arguments ({}), unknown keys,
    a raw newline inside a string (escaped, so the arguments parse)."""
    m = assert_split_invariant("hermes", '<tool_call>{"name": "f", "id": 3}')
    assert shape(m) == (None, [("f", "{}")])
    m = assert_split_invariant("hermes", hermes('{"name": "run", "arguments": {"code": "a\nb\tc"}}') + "}")
    assert json.loads(m.tool_calls[0].arguments) == {"code": "a\nb\tc"} and m.content == "}"


def test_hermes_holds_back_a_possible_tag():
    parser = parser_class("hermes")()
    assert parser.feed("Sure <tool_").content == "Sure "
    assert parser.feed("cal").empty
    first = parser.feed('l>{"name": "f", "argu')
    assert first.content == "" and first.calls == []  # the arguments have not begun
    out = parser.feed('ments": {"q": 1}}</tool_call>')
    assert [(d.index, d.name, d.arguments) for d in out.calls] == [(0, "f", '{"q": 1}')]
    assert out.calls[0].id.startswith("chatcmpl-tool-")
    assert parser.finish().empty and parser.completed == 1


def test_hermes_streams_arguments_as_they_come():
    parser = parser_class("hermes")()
    head = parser.feed('<tool_call>{"name": "f", "arguments": {"q": "ab')
    assert [(d.name, d.arguments) for d in head.calls] == [("f", '{"q": "ab')]
    more = parser.feed('cd"}}')
    assert [(d.index, d.name, d.id, d.arguments) for d in more.calls] == [(0, None, None, 'cd"}')]


# ---------------------------------------------------------------------- llama3_json


LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", "  \n", "<|python_tag|> "])
def test_llama_calls(prefix):
    text = prefix + LLAMA + "; " + '{"name": "now", "parameters": {}}'
    m = assert_split_invariant("llama3_json", text)
    assert shape(m) == (None, [("get_weather", '{"city": "Paris"}'), ("now", "{}")])


@pytest.mark.parametrize("text", [
    "The weather is nice.", '  {"name": "Bob", "age": 3}', 'Use {"name": "f", "parameters": {}} like this',
    '<|python_tag|>brave_search.call(query="x")', "   ", "", "<|python_", '{"name": "f", "parameters": 5',
])
def test_llama_text_stays_content(text):
    m = whole("llama3_json", text)
    assert m.content == text and m.tool_calls == []
    if text != '{"name": "f", "parameters": 5':  # that one breaks after the call was announced
        assert_split_invariant("llama3_json", text)


def test_llama_text_after_the_calls_is_content():
    m = assert_split_invariant("llama3_json", LLAMA + "\n\nThat is all.")
    assert shape(m) == ("\n\nThat is all.", [("get_weather", '{"city": "Paris"}')])
    m = assert_split_invariant("llama3_json", LLAMA + "\n" + LLAMA + ";")  # newline-separated calls, trailing ;
    assert len(m.tool_calls) == 2 and m.content is None


# ---------------------------------------------------------------------- any chunking

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=6), json_values, max_size=4)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,12}", fullmatch=True)
chunk_sizes = st.lists(st.integers(1, 9), min_size=1, max_size=8)


@SETTINGS
@given(st.lists(st.tuples(names, arguments), min_size=1, max_size=3), st.text(max_size=12), st.booleans(),
       st.sampled_from([None, 1]), chunk_sizes)
def test_hermes_property(calls, before, ascii_only, indent, sizes):
    body = "\n".join(hermes(json.dumps({"name": n, "arguments": a}, ensure_ascii=ascii_only, indent=indent))
                     for n, a in calls)
    text = before + body
    m = whole("hermes", text)
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [(n, a) for n, a in calls]
    want_content = before if before.strip() else None
    assert m.content == (want_content if "<tool_call>" not in before else m.content)
    got, _, broken = stream("hermes", sized(text, sizes))
    assert not broken and shape(got) == shape(m)


@SETTINGS
@given(st.lists(st.tuples(names, arguments), min_size=1, max_size=3), st.sampled_from(["; ", ";", "\n", ";\n"]),
       st.booleans(), chunk_sizes)
def test_llama_property(calls, sep, tag, sizes):
    text = ("<|python_tag|>" if tag else "") + sep.join(
        json.dumps({"name": n, "parameters": a}) for n, a in calls)
    m = whole("llama3_json", text)
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [(n, a) for n, a in calls]
    got, _, broken = stream("llama3_json", sized(text, sizes))
    assert not broken and shape(got) == shape(m) and m.content is None


PIECES = ["<tool_call>", "</tool_call>", "<|python_tag|>", "{", "}", "[", "]", '"name"', '"arguments"',
          '"parameters"', ":", ",", ";", '"f"', '"x"', "1", "-", ".", "e", "true", "nul", '"', "\\", "\\u00e9",
          " ", "\n", "a", "<", "|", "<|tool_call>", "<tool_call|>", "call:", '<|"|>']


@SETTINGS
@given(st.lists(st.sampled_from(PIECES), max_size=40).map("".join), chunk_sizes,
       st.sampled_from(sorted(TOOL_CALL_PARSERS)))
def test_any_text_any_chunking(text, sizes, name):
    """Never an exception; a stream that did not break equals the whole answer; with no call
    the content is the text exactly."""
    m = whole(name, text)
    if not m.tool_calls:
        assert m.content == text
    for c in m.tool_calls:
        json.loads(c.arguments)
    got, _, broken = stream(name, sized(text, sizes))
    if not broken:
        assert shape(got) == shape(m)
