"""--reasoning-parser through the HTTP front with the official openai client: reasoning_content
(and vLLM's ``reasoning``) beside content, the stream folding back into the non-streaming answer
for several chunkings, reasoning + tool calls (the tool parser reads only the content),
enable_thinking, include_reasoning / separate_reasoning, the length cap, n > 1, special-token
tags, and completions left alone."""

from __future__ import annotations

import json

import openai
import pytest

from tests.unit.front_harness import MODEL, start_stack
from tests.unit.front_tok import tokenizer_with_tags

ASK = [{"role": "user", "content": "What is six times seven?"}]
THOUGHT = "<think>\nSix sevens: 42. 日本語 😀\n</think>\n\nThe answer is 42."
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'


@pytest.fixture(scope="module")
def stack():
    s = start_stack(reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield s
    s.close()


@pytest.fixture(autouse=True)
def reset_fake(stack):
    stack.fake.tokens_per_step, stack.fake.output_fn = 1, None
    yield


def script(stack, text: str, eos: bool = True) -> None:
    ids = stack.tok.encode(text, add_special_tokens=False) + ([stack.tok.eos_id] if eos else [])
    stack.fake.output_fn = lambda req: list(ids)


def message(client, **kw):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, **kw)
    return r, r.choices[0]


def fold(chunks, index: int = 0) -> dict:
    """A stream folded as clients fold it: reasoning, content and tool calls joined per choice."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "order": []}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index != index:
                continue
            extra = choice.delta.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")
            if extra.get("reasoning_content"):
                out["reasoning"] += extra["reasoning_content"]
                out["order"].append("r")
            if choice.delta.content:
                out["content"] += choice.delta.content
                out["order"].append("c")
            for tc in choice.delta.tool_calls or []:
                call = out["calls"].setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
                call["arguments"] += tc.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def fields(choice) -> tuple:
    extra = choice.message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"]
    return extra["reasoning_content"], choice.message.content


def test_non_streaming_splits_reasoning_from_content(stack, client):
    script(stack, THOUGHT)
    r, choice = message(client)
    assert fields(choice) == ("\nSix sevens: 42. 日本語 😀\n", "\n\nThe answer is 42.")
    assert choice.finish_reason == "stop"
    assert r.usage.completion_tokens == len(stack.tok.encode(THOUGHT, add_special_tokens=False)) + 1  # + EOS


@pytest.mark.parametrize("tokens_per_step", [1, 2, 5])
def test_stream_folds_into_the_non_streaming_answer(stack, client, tokens_per_step):
    stack.fake.tokens_per_step = tokens_per_step
    script(stack, THOUGHT)
    r, choice = message(client)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, stream=True,
                                                 stream_options={"include_usage": True}))
    got = fold(chunks)
    assert (got["reasoning"], got["content"], got["finish"]) == (*fields(choice), "stop")
    assert got["order"] == sorted(got["order"], reverse=True)  # reasoning deltas, then content deltas
    assert not any("think>" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


@pytest.mark.parametrize("stream,tokens_per_step", [(False, 1), (True, 1), (True, 3)])
def test_reasoning_then_tool_calls(stack, client, stream, tokens_per_step):
    """The tool parser reads only what follows the think block; a call written inside the block
    is reasoning, not a call."""
    stack.fake.tokens_per_step = tokens_per_step
    text = "<think>Mention <tool_call> in passing; call it.</think>\n" + CALL % "Paris" + "\n" + CALL % "東京"
    script(stack, text)
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300)
    if stream:
        got = fold(client.chat.completions.create(stream=True, **kw))
        reasoning, content, finish = got["reasoning"], got["content"] or None, got["finish"]
        calls = [(c["name"], c["arguments"]) for _, c in sorted(got["calls"].items())]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        (reasoning, content), finish = fields(choice), choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert (reasoning, content, finish) == ("Mention <tool_call> in passing; call it.", None, "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"}),
                                                      ("get_weather", {"city": "東京"})]


def test_enable_thinking_false_is_all_content(stack, client):
    script(stack, "The answer is 42. </think> stays")
    _, choice = message(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert fields(choice) == (None, "The answer is 42. </think> stays")


def test_length_cap_inside_the_block_is_all_reasoning(stack, client):
    script(stack, THOUGHT)
    text = stack.tok.decode(stack.tok.encode(THOUGHT, add_special_tokens=False)[:9])
    choice = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=9).choices[0]
    assert choice.finish_reason == "length" and text.startswith("<think>") and "</think>" not in text
    assert fields(choice) == (text.removeprefix("<think>"), None)


def test_include_reasoning_false_and_separate_reasoning_false(stack, client):
    script(stack, THOUGHT)
    _, choice = message(client, extra_body={"include_reasoning": False})
    assert fields(choice) == (None, "\n\nThe answer is 42.")
    got = fold(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, stream=True,
                                              extra_body={"include_reasoning": False}))
    assert (got["reasoning"], got["content"]) == ("", "\n\nThe answer is 42.")
    _, choice = message(client, extra_body={"separate_reasoning": False})
    assert choice.message.content == THOUGHT and "reasoning_content" not in choice.message.model_extra
    _, choice = message(client, extra_body={"include_reasoning": None, "separate_reasoning": None})  # defaults
    assert fields(choice) == ("\nSix sevens: 42. 日本語 😀\n", "\n\nThe answer is 42.")


def test_n_choices_parse_separately(stack, client):
    script(stack, THOUGHT)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, n=2, stream=True))
    for i in (0, 1):
        got = fold(chunks, i)
        assert (got["reasoning"], got["content"]) == ("\nSix sevens: 42. 日本語 😀\n", "\n\nThe answer is 42.")


def test_completions_are_not_parsed(stack, client):
    script(stack, THOUGHT)
    r = client.completions.create(model=MODEL, prompt="Q:", max_tokens=200)
    assert r.choices[0].text == THOUGHT and "reasoning_content" not in (r.choices[0].model_extra or {})


def special_think_tokenizer(path: str) -> str:
    """A tokenizer whose think tags are special tokens: decoding must keep them for the parser."""
    return tokenizer_with_tags(path, ["<think>", "</think>"], special=True)


def test_special_token_tags_and_deepseek_r1(tmp_path):
    """deepseek_r1: the answer starts in reasoning without an opening tag; the tags are special
    tokens here, and still reach the parser."""
    s = start_stack(tok_dir=special_think_tokenizer(str(tmp_path)), reasoning_parser="deepseek_r1")
    try:
        assert s.tok.encode("</think>", add_special_tokens=False) == [s.tok.token_to_id("</think>")]
        script(s, "Six sevens.</think>It is 42.")
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0, timeout=20)
        _, choice = message(client)
        assert fields(choice) == ("Six sevens.", "It is 42.")
        got = fold(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, stream=True))
        assert (got["reasoning"], got["content"]) == ("Six sevens.", "It is 42.")
    finally:
        s.close()


def reasoning_tokens(usage) -> int | None:
    details = usage.completion_tokens_details  # the openai client's own field for it
    return None if details is None else details.reasoning_tokens


@pytest.mark.parametrize("parser,text", [("qwen3", "<think>\nSix sevens: 42. 日本語 😀\n</think>\n\nIt is 42."),
                                         ("deepseek_r1", "Six sevens: 42. 日本語 😀\n</think>It is 42."),
                                         ("qwen3", "<think>\nSix sevens: 42, and more")])
def test_usage_counts_the_reasoning_tokens(tmp_path, parser, text):
    """vLLM's ``usage.completion_tokens_details.reasoning_tokens``: the tokens between the tags
    (tags excluded; single-token tags here, as Qwen3's and DeepSeek-R1's), the same streamed at
    any chunking, summed over choices; 0 when the prompt closed the block; absent without a parser."""
    s = start_stack(tok_dir=special_think_tokenizer(str(tmp_path)), reasoning_parser=parser)
    try:
        thought = text.removeprefix("<think>").split("</think>")[0]
        want = len(s.tok.encode(thought, add_special_tokens=False))
        script(s, text, eos="</think>" in text)
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0, timeout=20)
        r, _ = message(client)
        assert reasoning_tokens(r.usage) == want and r.usage.completion_tokens > want
        for tokens_per_step in (1, 3):
            s.fake.tokens_per_step = tokens_per_step
            chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, stream=True,
                                                         n=2, stream_options={"include_usage": True}))
            assert reasoning_tokens(chunks[-1].usage) == 2 * want
        s.fake.tokens_per_step = 1
        r, _ = message(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert reasoning_tokens(r.usage) == (want if parser == "deepseek_r1" else 0)
        r, _ = message(client, extra_body={"separate_reasoning": False})
        assert reasoning_tokens(r.usage) is None
        r = client.completions.create(model=MODEL, prompt="Q:", max_tokens=200)
        assert reasoning_tokens(r.usage) is None
    finally:
        s.close()


def test_usage_counts_reasoning_tokens_of_multi_token_tags(stack, client):
    """Tags the tokenizer splits into pieces: the count is the tokens overlapping the block's text
    (a piece that also holds a tag's character counts), between the block's own token count and
    that plus the pieces of the two tags."""
    script(stack, THOUGHT)
    r, _ = message(client)
    inner = len(stack.tok.encode("\nSix sevens: 42. 日本語 😀\n", add_special_tokens=False))
    tags = len(stack.tok.encode("<think>", add_special_tokens=False)) + len(
        stack.tok.encode("</think>", add_special_tokens=False))
    assert inner - 2 <= reasoning_tokens(r.usage) <= inner + tags
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, stream=True,
                                                 stream_options={"include_usage": True}))
    assert reasoning_tokens(chunks[-1].usage) == reasoning_tokens(r.usage)
