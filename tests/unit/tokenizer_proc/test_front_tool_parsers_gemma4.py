"""The gemma4 tool-call parser: Gemma 4's call notation translated to JSON arguments.

Calls are written here the way Gemma 4's chat template writes an assistant's tool calls
(``<|tool_call>call:NAME{key:value,...}<tool_call|>``, strings between ``<|"|>``, bare keys,
sorted); a small recursive reader, written separately from the streaming parser, is the oracle.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.tool_parser_util import assert_split_invariant, shape, sized, stream, whole
from tokenizer_proc.tool_parsers.gemma4 import QUOTE, bare_json

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def gemma_value(v) -> str:
    """A value as Gemma 4's template writes it (format_argument, keys unquoted)."""
    if isinstance(v, str):
        return QUOTE + v + QUOTE
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{gemma_value(x)}" for k, x in sorted(v.items())) + "}"
    if isinstance(v, list):
        return "[" + ",".join(gemma_value(x) for x in v) + "]"
    return repr(v)


def gemma_call(name: str, args: dict) -> str:
    return f"<|tool_call>call:{name}{gemma_value(args)}<tool_call|>"


def read_value(s: str, i: int):
    """The oracle: (value, next index) of the Gemma value at s[i]."""
    if s.startswith(QUOTE, i):
        end = s.index(QUOTE, i + len(QUOTE))
        return s[i + len(QUOTE):end], end + len(QUOTE)
    if s[i] in "{[":
        close, out, i = ("}" if s[i] == "{" else "]"), ({} if s[i] == "{" else []), i + 1
        while s[i] != close:
            if close == "}":
                colon = s.index(":", i)
                key, i = s[i:colon], colon + 1
            value, i = read_value(s, i)
            if close == "}":
                out[key] = value
            else:
                out.append(value)
            i += s[i] == ","
        return out, i + 1
    end = min(j for j in (s.find(c, i) for c in ",}]") if j >= 0)
    return json.loads(bare_json(s[i:end])), end


def oracle_args(text: str) -> str:
    body = text[text.index("{"):text.rindex("<tool_call|>")]
    value, _ = read_value(body, 0)
    return json.dumps(value, ensure_ascii=False)


def test_template_shaped_call_to_json():
    args = {"city": 'Par"is\n', "days": 3, "units": ["C", 1.5, None], "nested": {"a b": True, "e": {}}, "l": []}
    text = "Let me look.\n" + gemma_call("get_weather", args) + gemma_call("now", {}) + "\n"
    m = assert_split_invariant("gemma4", text)
    assert m.content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [("get_weather", args), ("now", {})]
    assert m.tool_calls[0].arguments == oracle_args(gemma_call("get_weather", args))


@pytest.mark.parametrize("raw,want", [
    ("n:1.50", {"n": 1.5}), ("n:-3", {"n": -3}), ("b:None", {"b": None}), ("w:San Francisco", {"w": "San Francisco"}),
    ('<|"|>k<|"|>:1', {"k": 1}), ("x:<5", {"x": "<5"}), ("e:1e-05", {"e": 1e-05}),
])
def test_bare_values_and_quoted_keys(raw, want):
    m = assert_split_invariant("gemma4", "<|tool_call>call:f{" + raw + "}<tool_call|>")
    assert json.loads(m.tool_calls[0].arguments) == want


@pytest.mark.parametrize("text", [
    "<|tool_call>cal:f{}<tool_call|>", "<|tool_call>call:{}<tool_call|>", "<|tool_call>call:f g{}<tool_call|>",
    "plain <|tool text", "<tool_call|> stray end", "",
])
def test_not_a_call_is_content(text):
    m = assert_split_invariant("gemma4", text)
    assert shape(m) == (text, [])


def test_broken_arguments():
    text = "<|tool_call>call:f{x:,}<tool_call|>"
    assert shape(whole("gemma4", text)) == (text, [])
    streamed, _, broken = stream("gemma4", list(text))
    assert broken and streamed.tool_calls[0].name == "f"


keys = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)
strings = st.text(st.characters(blacklist_characters="<|", blacklist_categories=("Cs",)), max_size=8)
values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | strings | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=8,
)


@SETTINGS
@given(st.lists(st.tuples(keys, st.dictionaries(keys, values, max_size=4)), min_size=1, max_size=3),
       st.lists(st.integers(1, 9), min_size=1, max_size=8))
def test_gemma_property(calls, sizes):
    text = "".join(gemma_call(n, a) for n, a in calls)
    m = whole("gemma4", text)
    assert [c.name for c in m.tool_calls] == [n for n, _ in calls]
    for (_, args), call, raw in zip(calls, m.tool_calls, text.split("<tool_call|>"), strict=False):
        assert call.arguments == oracle_args(raw + "<tool_call|>")
        assert json.loads(call.arguments) == json.loads(json.dumps(args))
    got, _, broken = stream("gemma4", sized(text, sizes))
    assert not broken and shape(got) == shape(m)
