"""Every invalid request gets HTTP 400 (never 422) in vLLM's error shape; unknown model 404."""

from __future__ import annotations

import httpx
import pytest

from tests.unit.front_harness import MODEL, assert_error, start_stack


@pytest.fixture(scope="module")
def http():
    stack = start_stack()
    with httpx.Client(base_url=stack.base_url, timeout=20) as c:
        yield c
    stack.close()


COMPLETION_CASES = [
    ({"prompt": "x", "max_tokens": "five"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop": ["a", 3]}, "stop[1]"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"prompt": "x", "stop_token_ids": [100000]}, "stop_token_ids"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "stream": 2}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
    ({"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"100000": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "high"}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [1, [2]]}, "prompt"),
    ({"prompt": [-5]}, "prompt"),
    ({"prompt": [420]}, "prompt"),
    ({"prompt": [[1], [99999]]}, "prompt"),
    ({"prompt": "x", "max_tokens": 511}, "max_tokens"),
    ({"prompt": "x", "model": 3}, "model"),
]


@pytest.mark.parametrize("body,param", COMPLETION_CASES, ids=[str(c[0])[:60] for c in COMPLETION_CASES])
def test_completion_field_errors(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param)


CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    # OpenAI's per-role rules: a user/system/tool message needs content, roles are a closed set.
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": None}]}, "messages[1].content"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    # A refusal part is an assistant's only: a user's is refused, an assistant's needs its string.
    ({"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "refusal"}]}, {"role": "user", "content": "x"}]},
     "messages[0].content[0].refusal"),
    ({"messages": [{"role": "assistant"}]}, "messages[0].content"),
    # A part type that is not a string (schemathesis found the object case as a 500).
    ({"messages": [{"role": "assistant", "content": [{"type": {}, "text": ""}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name"),
    (["not", "an", "object"], None),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10_000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 3000}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("body,param", CHAT_CASES, ids=[str(c[0])[:60] for c in CHAT_CASES])
def test_chat_field_errors(http, body, param):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_chat_missing_content_message_names_the_field(http):
    err = assert_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user"}]}), 400)
    assert err["message"] == "Missing required parameter: 'messages[0].content'."


def test_chat_roles_openai_accepts(http):
    """Assistant turns with tool calls may omit content; developer and tool roles are valid."""
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                       "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
                {"role": "user", "content": "ok"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    ids = http.post("/tokenize", json={"messages": messages[-2:]}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "I can't." in text  # the refusal is rendered as the assistant's text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize",
                                  "/detokenize"])
def test_malformed_bodies(http, path):
    assert_error(http.post(path, content=b"{not json", headers={"content-type": "application/json"}))
    assert_error(http.post(path, content=b"[1, 2]", headers={"content-type": "application/json"}))
    assert_error(http.post(path, content=b"", headers={"content-type": "application/json"}))
    assert_error(http.post(path, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"}))
    assert_error(http.post(path, data={"prompt": "x"}))  # form-encoded


def test_context_length_message(http):
    err = assert_error(http.post("/v1/completions", json={"prompt": [5] * 500, "max_tokens": 20}), 400, "max_tokens")
    assert err["message"].startswith("This model's maximum context length is 512 tokens. However, you requested "
                                     "520 tokens (500 in the prompt, 20 for the completion).")


def test_unknown_model_is_404(http):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/tokenize", {"prompt": "x"})):
        assert_error(http.post(path, json={**body, "model": "other"}), 404, "model")


def test_unknown_fields_are_ignored(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "best_of": 1,
                                           "foo": {"bar": [1]}})
    assert r.status_code == 200


def test_lax_numbers_like_pydantic(http):
    body = {"prompt": "x", "max_tokens": "2", "n": 1.0, "stream": "false", "temperature": "0.5"}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_nulls_mean_defaults(http):
    body = {"prompt": "x", "max_tokens": None, "temperature": None, "stop": None, "logprobs": None, "n": None,
            "stream": None, "seed": None}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_native_errors(http):
    assert_error(http.post("/generate", json={"sampling_params": {}}), 400, "text")
    assert_error(http.post("/generate", json={"text": "x", "input_ids": [1]}), 400, "text")
    assert_error(http.post("/generate", json={"input_ids": [100000]}), 400)
    assert_error(http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": -1}}), 400,
                 "sampling_params.max_new_tokens")
    assert_error(http.post("/generate", json={"text": "x", "sampling_params": {"n": 2}}), 400, "sampling_params.n")
    assert_error(http.post("/tokenize", json={"prompt": "x", "messages": []}), 400)
    assert_error(http.post("/detokenize", json={"tokens": ["a"]}), 400, "tokens[0]")


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
