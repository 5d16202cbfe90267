"""The front with the hermes tool-call parser, for the tool-calling test files: a module-scoped
stack (fake engine, official openai client), its per-test reset, scripted model output, and a
stream folded back into one answer."""

from __future__ import annotations

import pytest

from tests.unit.front_harness import start_stack

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris and Tokyo?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'


@pytest.fixture(scope="module")
def stack():
    s = start_stack(enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield s
    s.close()


@pytest.fixture(autouse=True)
def reset_fake(stack):
    stack.fake.tokens_per_step, stack.fake.output_fn, stack.fake.eos_after = 1, None, None
    yield


def script(stack, text: str, eos: bool = True) -> None:
    """The fake engine answers every request with ``text`` (then EOS unless ``eos`` is False)."""
    ids = stack.tok.encode(text, add_special_tokens=False) + ([stack.tok.eos_id] if eos else [])
    stack.fake.output_fn = lambda req: list(ids)


def accumulate_stream(chunks) -> tuple[str | None, list[dict], str | None]:
    """A stream folded the way clients fold it: content joined, tool calls by index."""
    content, calls, finish = None, {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for tc in delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id.startswith("chatcmpl-tool-") and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish
