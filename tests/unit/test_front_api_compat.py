"""Request options that vLLM users send and the front once ignored or half-served:
continue_final_message, tool_choice, continuous usage stats on every chat chunk."""

from __future__ import annotations

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


def test_tool_choice_that_demands_a_call_is_400(stack, client, http):
    msgs = [{"role": "user", "content": "Hi"}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=2)
        assert exc.value.body["param"] == "tool_choice"
    r = http.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "tool_choice": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    for choice in ("auto", "none"):  # tools go to the template; the answer is text
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=2)
        assert r.choices[0].message.role == "assistant"


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
