"""Request options that vLLM users send and the front once ignored or half-served:
continue_final_message, tool_choice, continuous usage stats on every chat chunk."""

from __future__ import annotations

import httpx
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


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.base_url, timeout=20) as c:
        yield c


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
