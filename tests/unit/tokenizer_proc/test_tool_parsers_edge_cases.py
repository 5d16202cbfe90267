"""Tool-call parser edge cases, each checked whole and streamed under every split:
Qwen3 output with a <think> block before the calls, nested braces / escaped quotes / unicode in
strings, text after the last call, a call cut off by max_tokens, Llama 3.1 calls with and without
<|python_tag|> ("arguments" or "parameters", leading whitespace, ';' or newlines between calls),
and Gemma 4 calls in the notation vLLM's gemma4 parser reads
(``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>``, calls back to back)."""

from __future__ import annotations

import json

import pytest

from tests.unit.tool_parser_util import assert_split_invariant, shape, sized, stream, whole

Q = '<|"|>'
NASTY = {"code": 'if (a) { b("}{"); }', "q": 'say "hi" \\ there', "u": "東京 😀 é", "n": {"d": [1, {"e": []}]}}


def hermes(obj: dict, sep: str = "\n") -> str:
    return f"<tool_call>{sep}{json.dumps(obj, ensure_ascii=False)}{sep}</tool_call>"


def calls(m) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in m.tool_calls]


# ---------------------------------------------------------------------- hermes (Qwen)


def test_qwen3_think_block_before_calls():
    """No reasoning parser: the think block is content; a '<tool_call>' mentioned inside it that
    is not followed by a call object stays text."""
    think = "<think>\nThe user wants weather; I could emit <tool_call> tags.\n</think>\n\n"
    text = think + hermes({"name": "get_weather", "arguments": {"city": "Paris"}}) + "\n" + hermes(
        {"name": "get_time", "arguments": {}})
    m = assert_split_invariant("hermes", text)
    assert m.content == think
    assert calls(m) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("ascii_only", [False, True])
def test_hermes_nested_braces_escapes_and_unicode(ascii_only):
    raw = json.dumps({"name": "run", "arguments": NASTY}, ensure_ascii=ascii_only)
    m = assert_split_invariant("hermes", f"<tool_call>\n{raw}\n</tool_call>")
    assert m.content is None and calls(m) == [("run", NASTY)]
    # the arguments are the model's own JSON text, escapes kept as written
    assert m.tool_calls[0].arguments == raw[raw.index('"arguments": ') + 13:-1]


def test_hermes_text_after_the_last_call_is_content():
    text = hermes({"name": "f", "arguments": {"a": 1}}) + "\nI have asked for the weather."
    m = assert_split_invariant("hermes", text)
    assert m.content == "\nI have asked for the weather." and calls(m) == [("f", {"a": 1})]


@pytest.mark.parametrize("cut", ['"ar', '"arguments": {"code": "if (a) { b(', '"arguments": {"n": {"d": [1, '])
def test_hermes_call_cut_by_max_tokens(cut):
    """Whole: the cut call is content, exactly as generated. Streamed (any chunking): the call
    was announced once its arguments began, so it stays, its fragments followed by nothing."""
    text = 'Checking.\n<tool_call>\n{"name": "run", ' + cut
    m = whole("hermes", text)
    assert (m.content, m.tool_calls) == (text, [])
    outcomes = set()
    for sizes in ([1], [2], [5], [len(text)]):
        got, _, broken = stream("hermes", sized(text, sizes))
        content, got_calls = shape(got)
        outcomes.add((content, tuple(got_calls), broken))
    assert len(outcomes) == 1
    content, got_calls, broken = outcomes.pop()
    if "arguments" in cut and cut.index("{") > 0:
        assert broken and content == "Checking.\n" and got_calls == (("run", cut[cut.index("{"):]),)
    else:
        assert not broken and (content, got_calls) == (text, ())


# ---------------------------------------------------------------------- llama3_json


@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", "  \n", "\n<|python_tag|> "])
@pytest.mark.parametrize("key", ["parameters", "arguments"])
def test_llama_call_spellings(prefix, key):
    text = prefix + json.dumps({"name": "get_weather", key: NASTY}, ensure_ascii=False)
    m = assert_split_invariant("llama3_json", text)
    assert m.content is None and calls(m) == [("get_weather", NASTY)]


@pytest.mark.parametrize("sep", ["; ", ";", "\n", "\n\n", " ;\n"])
def test_llama_several_calls(sep):
    one = json.dumps({"name": "a", "parameters": {"x": 1}})
    two = json.dumps({"name": "b", "parameters": {"y": "}"}})
    m = assert_split_invariant("llama3_json", "<|python_tag|>" + one + sep + two)
    assert m.content is None and calls(m) == [("a", {"x": 1}), ("b", {"y": "}"})]


@pytest.mark.parametrize("text", [
    '{"name": "Ada", "age": 36}',  # a JSON answer is not a call
    'Here you go: {"name": "f", "parameters": {}}',  # a call must come first
    '[{"name": "f", "parameters": {}}]',
])
def test_llama_not_calls_stay_content(text):
    m = assert_split_invariant("llama3_json", text)
    assert (m.content, m.tool_calls) == (text, [])


def test_llama_text_after_calls():
    text = '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}} and that is all'
    m = assert_split_invariant("llama3_json", text)
    assert calls(m) == [("f", {"a": 1}), ("g", {})] and m.content == " and that is all"


# ---------------------------------------------------------------------- gemma4


def test_gemma4_format_as_vllm_reads_it():
    """Strings between <|"|> are not escaped (quotes, braces, commas, colons and newlines are
    data); keys are bare; numbers, true/false/null bare; calls back to back, text around them."""
    s = f"{Q}a {{b}}, c: \"d\" \\ e\nf{Q}"
    text = (f"Let me look.<|tool_call>call:search{{query:{s},limit:10,exact:false,filters:{{lang:{Q}日本語{Q},"
            f"tags:[{Q}x{Q},{Q}y{Q}]}},score:0.5,after:null}}<tool_call|>"
            f"<|tool_call>call:get_time{{}}<tool_call|>Done.")
    m = assert_split_invariant("gemma4", text)
    assert m.content == "Let me look.Done."
    assert calls(m) == [("search", {"query": 'a {b}, c: "d" \\ e\nf', "limit": 10, "exact": False,
                                    "filters": {"lang": "日本語", "tags": ["x", "y"]}, "score": 0.5,
                                    "after": None}), ("get_time", {})]


def test_gemma4_call_cut_by_max_tokens():
    text = f"<|tool_call>call:search{{query:{Q}a long qu"
    assert shape(whole("gemma4", text)) == (text, [])
    for sizes in ([1], [3], [len(text)]):
        got, _, broken = stream("gemma4", sized(text, sizes))
        assert broken and shape(got) == (None, [("search", '{"query": "a long qu')])
