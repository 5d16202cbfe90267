"""The front with the hermes tool-call parser, for the tool-calling test files: a module-scoped
stack (fake engine, official openai client), its per-test reset, and scripted model output."""

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
