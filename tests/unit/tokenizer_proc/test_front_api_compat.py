"""Request options that vLLM users send and the front once ignored or half-served:
continue_final_message, tool_choice, continuous usage stats on every chat chunk, stop_reason."""

from __future__ import annotations

import json

import openai
import pytest

from proto.arrays import view_i32
from proto.messages import GenerateReq
from tests.unit.front_harness import MODEL, start_stack

PREFILL = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, "}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def stack():
    s = start_stack()
    yield s
    s.close()


def last_prompt(stack) -> str:
    req = stack.fake.of_type(GenerateReq)[-1]
    return stack.tok.decode(view_i32(req.prompt_ids).tolist(), skip_special_tokens=False)


def test_continue_final_message_leaves_the_turn_open(stack, http):
    # The chatml template closes every turn with <|im_end|>; continuing must not.
    want = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nWell, "
    for extra in ({"add_generation_prompt": False}, {}):  # unset add_generation_prompt gives way
        body = {"messages": PREFILL, "max_tokens": 2, "continue_final_message": True, **extra}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert last_prompt(stack) == want
        tok = http.post("/tokenize", json={"messages": PREFILL, "continue_final_message": True}).json()
        assert stack.tok.decode(tok["tokens"], skip_special_tokens=False) == want
    # Without it, the assistant turn is closed and no new one is opened (add_generation_prompt off).
    http.post("/v1/chat/completions", json={"messages": PREFILL, "max_tokens": 2, "add_generation_prompt": False})
    assert last_prompt(stack).endswith("Well, <|im_end|>\n")


def test_continue_final_message_with_generation_prompt_is_400(http):
    body = {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": True}
    for path in ("/v1/chat/completions", "/tokenize"):
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "continue_final_message"


def test_tool_choice_that_demands_a_call_needs_no_server_flags(stack, client, http):
    """Forced calls are constrained decoding, not a parser (test_front_structured_tools.py)."""
    msgs = [{"role": "user", "content": "Hi"}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=2)
        assert stack.fake.of_type(GenerateReq)[-1].params.grammar.kind == "json"
    r = http.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "tool_choice": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_auto_tool_choice_needs_the_server_flags(client, http):
    """vLLM's rule: tool_choice "auto", explicit or implied by tools, is a 400 unless the server
    runs with --enable-auto-tool-choice and --tool-call-parser; "none" answers with text (the
    tools still reach the template); a tool_choice without tools is a 400 too."""
    msgs = [{"role": "user", "content": "Hi"}]
    for extra in ({"tool_choice": "auto"}, {}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=2, **extra)
        err = exc.value.body
        assert err["param"] == "tool_choice" and err["code"] == 400 and err["type"] == "BadRequestError"
        assert err["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                  "to be set")
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    for choice in ("auto", "required"):
        r = http.post("/v1/chat/completions", json={"messages": msgs, "tool_choice": choice, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["message"] == "When using `tool_choice`, `tools` must be set."
    r = http.post("/v1/chat/completions", json={"messages": msgs, "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("n", [1, 2])
def test_chat_continuous_usage_on_every_chunk(stack, client, n):
    """vLLM's contract (its own stream_options test): with continuous_usage_stats, chunk.usage is
    set on every chunk, the role chunk included, and counts that choice's tokens so far."""
    stack.fake.output_fn = lambda req: stack.tok.encode("one two three", add_special_tokens=False)
    try:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=20, n=n, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    finally:
        stack.fake.output_fn = None
    assert all(c.usage is not None for c in chunks)
    prompt = chunks[-1].usage.prompt_tokens
    for c in chunks[:n]:  # one role chunk per choice, nothing generated yet
        assert c.choices[0].delta.role == "assistant"
        assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (prompt, 0, prompt)
    for c in chunks:
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n * len(
        stack.tok.encode("one two three", add_special_tokens=False))


def test_continuous_usage_stats_alone_sends_no_usage(stack, client):
    """vLLM sends usage on every chunk only when include_usage is true as well."""
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
        stream_options={"continuous_usage_stats": True}))
    assert chunks and all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def _last_choice(http, path: str, body: dict, stream: bool) -> dict:
    r = http.post(path, json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]][-1]["choices"][0]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_reason_like_vllm(stack, http, path, stream):
    """null on the tokenizer's EOS (also when a stop_token_ids entry is that EOS, unless
    ignore_eos); the id for another stop token (a user's, or a second generation_config EOS);
    the string for a stop string; null on length."""
    eos = stack.tok.eos_id
    ids = stack.tok.encode("one two three four", add_special_tokens=False)
    stack.fake.output_fn = lambda req: ids[:2] + [eos] + ids[2:]
    prompt = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    cases = [
        ({}, "stop", None),
        ({"stop_token_ids": [ids[1]]}, "stop", ids[1]),
        ({"stop_token_ids": [eos]}, "stop", None),
        ({"stop_token_ids": [eos], "ignore_eos": True}, "stop", eos),
        ({"stop": ["n"]}, "stop", "n"),
        ({"max_tokens": 1}, "length", None),
    ]
    try:
        for extra, finish, reason in cases:
            choice = _last_choice(http, path, {**prompt, "max_tokens": 10, **extra}, stream)
            assert (choice["finish_reason"], choice["stop_reason"]) == (finish, reason), extra
        stack.fake.extra_eos = (ids[1],)
        choice = _last_choice(http, path, {**prompt, "max_tokens": 10}, stream)
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ids[1])
    finally:
        stack.fake.output_fn, stack.fake.extra_eos = None, ()


def test_generate_keeps_the_eos_id_as_matched_stop(stack, http):
    """/generate is SGLang's: its matched_stop is the EOS id itself."""
    eos = stack.tok.eos_id
    stack.fake.output_fn = lambda req: stack.tok.encode("a b", add_special_tokens=False) + [eos]
    try:
        r = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 10}}).json()
    finally:
        stack.fake.output_fn = None
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


def test_chat_echo_repeats_the_prefill(stack, client):
    """vLLM's chat echo: with a final assistant message (a prefill), the answer starts with it,
    streamed as its own chunk after the role chunk; another last turn echoes nothing."""
    stack.fake.output_fn = lambda req: stack.tok.encode("more", add_special_tokens=False)
    try:
        kw = dict(model=MODEL, max_tokens=5, extra_body={"echo": True, "continue_final_message": True})
        r = client.chat.completions.create(messages=PREFILL, **kw)
        assert r.choices[0].message.content == "Well, more"
        chunks = list(client.chat.completions.create(messages=PREFILL, stream=True, n=2, **kw))
        texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in (0, 1)}
        assert texts == {0: "Well, more", 1: "Well, more"}
        assert [c.choices[0].delta.content for c in chunks[2:4]] == ["Well, ", "Well, "]
        plain = client.chat.completions.create(model=MODEL, messages=PREFILL[:1], max_tokens=5, extra_body={"echo": True})
        assert plain.choices[0].message.content == "more"
    finally:
        stack.fake.output_fn = None


def test_echo_max_tokens_zero_needs_a_free_position(stack, http):
    """echo + max_tokens=0 still has the engine generate one (discarded) token: a prompt that fills
    the context is a 400 before the stream starts, never a 200 followed by an error event."""
    full = [5] * stack.engine.info.max_context
    for stream in (False, True):
        r = http.post("/v1/completions", json={"prompt": full, "max_tokens": 0, "echo": True, "stream": stream})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "max_tokens"
    r = http.post("/v1/completions", json={"prompt": full[1:], "max_tokens": 0, "echo": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0
