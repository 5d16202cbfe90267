"""Tool calling through the HTTP front (--enable-auto-tool-choice --tool-call-parser hermes) with
the official openai client: the non-streaming message, the stream accumulated back into it, the
finish reasons, tool choices, history validation, special-token tags, and the CLI flags."""

from __future__ import annotations

import json

import openai
import pytest

from proto.messages import GenerateReq
from tandem.cli import main as cli_main
from tests.unit.front_harness import MODEL, start_stack
from tests.unit.front_tok import tokenizer_with_tags
from tests.unit.tool_stack import ASK, CALL, TOOLS, accumulate_stream, reset_fake, script, stack  # noqa: F401 - fixtures

TWO_CALLS = "Let me check.\n" + CALL % "Paris" + "\n" + CALL % "東京 😀"


def test_non_streaming_tool_calls(stack, client):
    script(stack, TWO_CALLS)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    calls = choice.message.tool_calls  # the client's own tool-call models
    assert [c.model_dump(exclude_none=True) for c in calls] == [
        {"id": c.id, "type": "function", "function": {"name": "get_weather", "arguments": c.function.arguments}}
        for c in calls]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"city": "東京 😀"}]
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls) and calls[0].id != calls[1].id
    assert choice.model_extra["stop_reason"] is None  # ended on EOS


@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_stream_accumulates_to_the_non_streaming_answer(stack, client, tokens_per_step):
    stack.fake.tokens_per_step = tokens_per_step
    script(stack, TWO_CALLS)
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200)
    full = resp.choices[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                                 stream=True, stream_options={"include_usage": True}))
    content, calls, finish = accumulate_stream(chunks)
    assert (content, finish) == (full.message.content, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in full.message.tool_calls]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    assert not any("<tool" in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_n_choices_parse_separately(stack, client):
    script(stack, CALL % "Paris")
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, n=2,
                                                 stream=True))
    for i in (0, 1):
        content, calls, finish = accumulate_stream(
            [c.model_copy(update={"choices": [x for x in c.choices if x.index == i]}) for c in chunks])
        assert (content, finish) == (None, "tool_calls")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("stream", [False, True])
def test_answers_without_a_call_are_text(stack, client, stream):
    cases = [("It is sunny.", True, "stop"), ("<tool_call>{broken</tool_call> ok", True, "stop"),
             ("cut short", False, "length")]
    for text, eos, finish in cases:
        script(stack, text, eos)
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=40 if eos else 4)
        if stream:
            content, calls, got_finish = accumulate_stream(client.chat.completions.create(stream=True, **kw))
        else:
            r = client.chat.completions.create(**kw).choices[0]
            content, calls, got_finish = r.message.content, r.message.tool_calls or [], r.finish_reason
        want = text if eos else stack.tok.decode(stack.tok.encode(text, add_special_tokens=False)[:4])
        assert (content, calls, got_finish) == (want, [], finish)


def test_tool_choice_none_and_auto(stack, client):
    """("required" and named choices: test_front_structured_tools.py)"""
    script(stack, CALL % "Paris")
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=200)
    assert r.choices[0].message.content == CALL % "Paris" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="sometimes")
    assert exc.value.body["param"] == "tool_choice"
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"


def test_history_with_tool_calls(stack, client, http):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    script(stack, "It is 18 C in Paris.")
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=40)
    assert r.choices[0].message.content == "It is 18 C in Paris." and r.choices[0].finish_reason == "stop"
    for bad, param in (('{"city": ', "messages[1].tool_calls[0].function.arguments"),
                       (None, "messages[1].tool_calls[0].function.name")):
        call = {"id": "c1", "type": "function", "function": {"arguments": bad or "{}"}}
        if bad is not None:
            call["function"]["name"] = "f"
        body = {"messages": ASK + [{"role": "assistant", "tool_calls": [call]}], "tools": TOOLS}
        resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def special_tag_tokenizer(path: str) -> str:
    """A tokenizer whose <tool_call> tags are special tokens (as in some Hermes checkpoints)."""
    return tokenizer_with_tags(path, ["<tool_call>", "</tool_call>"], special=True)


def test_tags_that_are_special_tokens_reach_the_parser(tmp_path):
    """Decoding skips special tokens by default; with the parser on it keeps them (vLLM's hermes
    parser does the same), so the calls parse; a request without tools still skips them."""
    stack = start_stack(tok_dir=special_tag_tokenizer(str(tmp_path)), enable_auto_tool_choice=True,
                        tool_call_parser="hermes")
    try:
        tag = stack.tok.token_to_id("<tool_call>")
        assert stack.tok.encode(CALL % "Paris", add_special_tokens=False)[0] == tag
        script(stack, CALL % "Paris")
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0, timeout=20)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200).choices[0]
        assert [c.function.name for c in r.message.tool_calls] == ["get_weather"] and r.message.content is None
        plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200).choices[0]
        assert "<tool_call>" not in plain.message.content and '"get_weather"' in plain.message.content
        assert len(stack.fake.of_type(GenerateReq)) >= 2
    finally:
        stack.close()


@pytest.mark.parametrize("argv,needle", [
    (["--tool-call-parser", "nope"], "--tool-call-parser: expected one of hermes, llama3_json, gemma4, got 'nope'"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice: requires --tool-call-parser"),
])
def test_cli_rejects_bad_tool_flags(capsys, argv, needle):
    assert cli_main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_cli_help_lists_the_tool_flags(capsys):
    assert cli_main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--enable-auto-tool-choice" in out and "--tool-call-parser" in out and "llama3_json" in out
