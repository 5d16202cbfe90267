"""Tool calling as a vLLM user drives it, cases found in review: earlier tool calls whose
arguments nest too deeply (a 400, never a 500), ``parallel_tool_calls=false`` (only the first
call, as vLLM), malformed ``tools`` (400s naming the field, as vLLM's request model), and the
openai client's own stream helper folding a stream back into the non-streaming answer."""

from __future__ import annotations

import json

import openai
import pytest

from tests.unit.front_harness import MODEL, start_stack
from tests.unit.front_tok import shared_tokenizer_dir
from tokenizer_proc.chat_template import ChatTemplate, ChatTemplateError
from tokenizer_proc.tokenizer import TextTokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris and Tokyo?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
TWO_CALLS = "Let me check.\n" + CALL % "Paris" + "\n" + CALL % "Tokyo"


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
    ids = stack.tok.encode(text, add_special_tokens=False) + ([stack.tok.eos_id] if eos else [])
    stack.fake.output_fn = lambda req: list(ids)


def history(arguments) -> list[dict]:
    return ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]


# ---------------------------------------------------------------------- deep nesting


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("raw", ['{"a":' * 5000 + "1" + "}" * 5000, "[" * 100000 + "]" * 100000])
def test_arguments_nested_too_deeply_are_a_400(http, raw, stream):
    """json.loads raises RecursionError (not ValueError) on deep nesting: it was a 500."""
    body = {"messages": history(raw), "tools": TOOLS, "max_tokens": 2, "stream": stream}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[1].tool_calls[0].function.arguments" and "nested too deeply" in err["message"]
    r = http.post("/tokenize", json={"messages": history(raw)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    assert http.get("/health").status_code == 200


def test_a_template_that_recurses_is_a_template_error():
    """Rendering that runs out of stack (a deep structure through ``tojson``, a recursive
    template) is the request's 400, like the template's other failures."""
    tok = TextTokenizer(shared_tokenizer_dir("chatml"))
    tmpl = ChatTemplate("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(messages) }}", tok)
    with pytest.raises(ChatTemplateError, match="nested too deeply"):
        tmpl.render([{"role": "user", "content": "hi"}])
