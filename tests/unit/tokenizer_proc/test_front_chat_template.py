"""--chat-template (a file or inline Jinja) through the HTTP front, and the request's own
``chat_template`` field behind --trust-request-chat-template, seen with the openai client and
/tokenize (which renders a chat exactly as /v1/chat/completions does)."""

from __future__ import annotations

import openai
import pytest

from tests.unit.front_harness import MODEL, start_stack
from tests.unit.front_tok import shared_tokenizer_dir

ASK = [{"role": "user", "content": "Hello world"}]
SERVER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
REQUEST_TEMPLATE = "{{ messages[-1]['content'] | upper }} =>"


@pytest.fixture(scope="module")
def stack():
    s = start_stack(chat_template=SERVER_TEMPLATE, trust_request_chat_template=True)
    yield s
    s.close()


def rendered(stack, http, **body) -> str:
    r = http.post("/tokenize", json={"model": MODEL, "messages": ASK, **body})
    assert r.status_code == 200, r.text
    return stack.tok.decode(r.json()["tokens"], skip_special_tokens=False)


def test_server_template_replaces_the_tokenizers(stack, http, client):
    assert rendered(stack, http) == "[user] Hello world\n[assistant] "
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)
    want = len(stack.tok.encode("[user] Hello world\n[assistant] ", add_special_tokens=False))
    assert r.usage.prompt_tokens == want


def test_request_template_when_trusted(stack, http, client):
    assert rendered(stack, http, chat_template=REQUEST_TEMPLATE) == "HELLO WORLD =>"
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3,
                                       extra_body={"chat_template": REQUEST_TEMPLATE})
    assert r.usage.prompt_tokens == len(stack.tok.encode("HELLO WORLD =>", add_special_tokens=False))
    # vLLM also reads it from chat_template_kwargs
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3,
                                       extra_body={"chat_template_kwargs": {"chat_template": REQUEST_TEMPLATE}})
    assert r.usage.prompt_tokens == len(stack.tok.encode("HELLO WORLD =>", add_special_tokens=False))


@pytest.mark.parametrize("template,needle", [
    ("{% for m in messages %}", "chat_template: chat template does not compile"),
    ("{{ raise_exception('no way') }}", "chat template error: no way"),
])
def test_bad_request_template_is_a_400(stack, client, template, needle):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"chat_template": template})
    assert needle in exc.value.body["message"]


def test_request_template_refused_without_the_flag(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(SERVER_TEMPLATE)
    s = start_stack(chat_template=str(path))  # a file this time; no --trust-request-chat-template
    try:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)
        assert r.usage.prompt_tokens == len(s.tok.encode("[user] Hello world\n[assistant] ", add_special_tokens=False))
        for extra in ({"chat_template": REQUEST_TEMPLATE}, {"chat_template_kwargs": {"chat_template": "x{{ y }}"}}):
            with pytest.raises(openai.BadRequestError) as exc:
                client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra)
            assert exc.value.body["param"] == "chat_template"
            assert "--trust-request-chat-template" in exc.value.body["message"]
    finally:
        s.close()


def test_model_without_template(tmp_path):
    """No template anywhere: today's plain 'role: content' fallback, unless --chat-template gives one."""
    bare = shared_tokenizer_dir("none")
    for flag, want in ((None, "<s>user: Hello world\nassistant:"), (SERVER_TEMPLATE, "[user] Hello world\n[assistant] ")):
        s = start_stack(tok_dir=bare, chat_template=flag)
        try:
            client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
            r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)
            assert r.usage.prompt_tokens == len(s.tok.encode(want, add_special_tokens=False)), flag
        finally:
            s.close()
