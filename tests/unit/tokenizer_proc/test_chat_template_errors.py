"""--chat-template / request chat_template / --reasoning-parser through the HTTP front:
a template that fails while rendering (any exception, not only jinja's) is the request's 400 in
the OpenAI error shape, never a 500, for chat and /tokenize alike."""

from __future__ import annotations

import pytest

from tests.unit.front_harness import MODEL, start_stack

ASK = [{"role": "user", "content": "Hi"}]
RENDER_FAILURES = ["{{ 1/0 }}", "{{ range(10**9) | list | length }}", "{{ raise_exception('no system role') }}",
                   "{{ messages[5]['content'] }}", "{{ (2 ** 10000) | float }}"]


@pytest.fixture(scope="module")
def stack():
    s = start_stack(reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes",
                    trust_request_chat_template=True)
    yield s
    s.close()


def assert_openai_400(r) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]


@pytest.mark.parametrize("template", RENDER_FAILURES)
@pytest.mark.parametrize("stream", [False, True])
def test_request_template_failing_at_render_time_is_400(stack, http, template, stream):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 3, "stream": stream,
                                                 "chat_template": template})
    assert_openai_400(r)


@pytest.mark.parametrize("template", RENDER_FAILURES)
def test_tokenize_with_failing_template_is_400(stack, http, template):
    r = http.post("/tokenize", json={"model": MODEL, "messages": ASK, "chat_template": template})
    assert_openai_400(r)


@pytest.mark.parametrize("template", ["{{ 1/0 }}", "{{ raise_exception('refused') }}"])
def test_server_template_failing_at_render_time_is_400(template):
    s = start_stack(chat_template=template)
    try:
        import httpx

        with httpx.Client(base_url=s.base_url, timeout=30) as http:
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 3})
            assert_openai_400(r)
            assert http.get("/health").status_code == 200
    finally:
        s.close()


def test_all_reasoning_answer_sent_back_as_history(stack, client):
    """--reasoning-parser answers ``content: null`` when the block took every token (a length
    cut); a client appending that message to the next request's history must not get a 400."""
    ids = stack.tok.encode("still thinking", add_special_tokens=False)
    stack.fake.output_fn = lambda req: list(ids)
    try:
        first = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=len(ids))
        answer = first.choices[0].message
        assert answer.content is None and answer.model_extra["reasoning_content"] == "still thinking"
        history = [*ASK, answer.model_dump(exclude_none=False), {"role": "user", "content": "go on"}]
        r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=len(ids))
        assert r.choices[0].message.model_extra["reasoning_content"] == "still thinking"
    finally:
        stack.fake.output_fn = None


def test_null_content_without_reasoning_or_calls_is_still_400(stack, http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        *ASK, {"role": "assistant", "content": None}, {"role": "user", "content": "go on"}]})
    assert_openai_400(r)


DEEP = ["{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "{% if x %}" * 500 + "{% endif %}" * 500]


@pytest.mark.parametrize("template", DEEP)
def test_request_template_nested_too_deeply_is_400(stack, http, template):
    """jinja's parser recurses per nesting level: a RecursionError while compiling was a 500."""
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2,
                                                 "chat_template": template})
    assert_openai_400(r)
    assert r.json()["error"]["param"] == "chat_template"
    assert http.get("/health").status_code == 200
