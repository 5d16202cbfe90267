"""Structured output through a real `tandem serve` (the bundled pair: MTP on, overlap depth 3)
with the official openai client: every answer stays inside its grammar, concurrent constrained
and free requests share batches, and a grammar the worker cannot compile is a 400."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai import OpenAI

from tests.helpers.server import Server

SCHEMA = {"type": "object", "properties": {"verdict": {"enum": ["guilty", "innocent"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["verdict", "count"], "additionalProperties": False}
CHOICES = ["To be", "not to be", "the question"]
REGEX = r"(Thou|Thee) (art|hast) [a-z]{2,8}\."


@pytest.fixture(scope="module")
def client():
    # The bundled pair (MTP on). The tiny model runs away on whitespace where JSON allows any, so
    # JSON grammars take fixed separators here (the default, any whitespace, is the engine tests').
    with Server(None, "--constrained-json-disable-any-whitespace") as srv:
        yield OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=120)


def _chat(client, content, **kw):
    return client.chat.completions.create(model="tiny-shakespeare", messages=[{"role": "user", "content": content}],
                                          max_tokens=kw.pop("max_tokens", 120), **kw)


def test_json_schema_answer_parses_and_follows_the_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    for temperature in (0.0, 0.8):
        r = _chat(client, "Is Hamlet guilty?", response_format=fmt, temperature=temperature, seed=3)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", text
        value = json.loads(text)
        assert set(value) == {"verdict", "count"} and value["verdict"] in ("guilty", "innocent")
        assert isinstance(value["count"], int) and 0 <= value["count"] <= 9


def test_choice_and_regex_under_concurrency(client):
    """Constrained rows (each step of theirs waits for the tokens in flight) beside free ones."""
    def one(i):
        if i % 3 == 0:
            r = _chat(client, f"Speak {i}", extra_body={"structured_outputs": {"choice": CHOICES}},
                      temperature=1.0, seed=i)
            return "choice", r.choices[0].message.content, r.choices[0].finish_reason
        if i % 3 == 1:
            r = client.completions.create(model="tiny-shakespeare", prompt=f"ROMEO {i}:", max_tokens=40,
                                          temperature=0.7, seed=i, extra_body={"guided_regex": REGEX})
            return "regex", r.choices[0].text, r.choices[0].finish_reason
        r = client.completions.create(model="tiny-shakespeare", prompt=f"JULIET {i}:", max_tokens=24, temperature=0)
        return "free", r.choices[0].text, r.choices[0].finish_reason

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(24)))
    for kind, text, finish in results:
        if kind == "choice":
            assert text in CHOICES and finish == "stop", (text, finish)
        elif kind == "regex":
            assert finish == "stop" and re.fullmatch(REGEX, text), (text, finish)
        else:
            assert finish == "length" and text


def test_streamed_answer_equals_the_whole_one(client):
    kw = dict(extra_body={"structured_outputs": {"regex": REGEX}}, temperature=0)
    whole = _chat(client, "Say something", **kw).choices[0].message.content
    chunks = _chat(client, "Say something", stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert re.fullmatch(REGEX, whole)


def test_tool_choice_required_gives_calls(client):
    tools = [{"type": "function", "function": {"name": "duel", "parameters": {
        "type": "object", "properties": {"with": {"enum": ["Laertes", "Tybalt"]}}, "required": ["with"]}}}]
    for seed in range(3):
        choice = _chat(client, "Fight!", tools=tools, tool_choice="required", temperature=0.7, seed=seed,
                       max_tokens=160).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.function.name == "duel"
            assert json.loads(call.function.arguments)["with"] in ("Laertes", "Tybalt")
    named = {"type": "function", "function": {"name": "duel"}}
    choice = _chat(client, "Fight!", tools=tools, tool_choice=named, temperature=0).choices[0]
    assert choice.finish_reason == "stop"
    assert json.loads(choice.message.tool_calls[0].function.arguments)["with"] in ("Laertes", "Tybalt")


def test_a_grammar_that_does_not_compile_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, "Hi", extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert "invalid regex grammar" in exc.value.body["message"]
    assert _chat(client, "Hi", max_tokens=4).choices[0].finish_reason == "length"  # the server lives on


def test_structural_tag_response_format(client):
    """``response_format`` structural_tag (xgrammar's format object), through the official client:
    a tag around a constrained body (a regex: a JSON body inside a tag takes any whitespace, on
    which the tiny model runs away); a malformed tag is a 400 naming the field."""
    fmt = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<verdict>"}, {"type": "regex", "pattern": "(guilty|innocent), [0-9]"},
        {"type": "const_string", "value": "</verdict>"}]}}
    for stream in (False, True):
        r = _chat(client, "Judge him.", response_format=fmt, temperature=0.8, seed=5, stream=stream)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            assert finish == "stop", text
        assert re.fullmatch(r"<verdict>(guilty|innocent), [0-9]</verdict>", text), text
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, "Hi", response_format={"type": "structural_tag"})
    assert exc.value.body["param"] == "response_format"
