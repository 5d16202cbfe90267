"""Front fixes found by the e2e API tests (tests/e2e/test_e2e_api*.py), checked against the fake
engine: deep JSON, oversized text refused before tokenizing, min_tokens over max_tokens, and
/generate's default length and logprob options."""

from __future__ import annotations

import time

import pytest

from proto.messages import GenerateReq
from tests.unit.front_harness import assert_error, start_stack

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack():
    s = start_stack(max_request_body_bytes=64 << 20)  # past the body limit: the text-length guard
    yield s
    s.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"])
def test_deeply_nested_json_is_400(http, path):
    body = b'{"prompt": "x", "deep": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    err = assert_error(http.post(path, content=body, headers={"content-type": "application/json"}))
    assert "nested too deeply" in err["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "word " * 2_000_000}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "word " * 2_000_000]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w" * 10_000_000}]}, "messages"),
    ("/generate", {"text": "w" * 10_000_000}, "text"),
    ("/tokenize", {"prompt": "w" * 10_000_000}, "prompt"),
])
def test_oversized_text_is_refused_before_tokenizing(http, path, body, param):
    t0 = time.monotonic()
    err = assert_error(http.post(path, json=body), 400, param)
    assert time.monotonic() - t0 < 3.0  # tokenizing 10 MB would take tens of seconds
    assert "maximum context length is 512 tokens" in err["message"]


def test_text_just_under_the_bound_is_tokenized(http, stack):
    cap = stack.tok.max_text_chars(512)
    err = assert_error(http.post("/v1/completions", json={"prompt": "a" * cap}), 400, "max_tokens")
    assert "in the prompt" in err["message"]  # the ordinary token-count check, after tokenizing
    assert http.post("/tokenize", json={"prompt": "hello"}).json()["count"] >= 1


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1, "min_new_tokens": 2}},
     "sampling_params.min_new_tokens"),
])
def test_min_tokens_over_max_tokens(http, path, body, param):
    assert_error(http.post(path, json=body), 400, param)


def test_min_tokens_equal_to_max_tokens_is_fine(http):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "min_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_generate_default_length_fits_the_context(http, stack):
    ids = [5] * 500  # 512-token context: SGLang's default 128 would not fit
    r = http.post("/generate", json={"input_ids": ids})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 12
    req = stack.fake.of_type(GenerateReq)[-1]
    assert req.params.max_new_tokens == 12
    assert_error(http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 13}}), 400,
                 "sampling_params.max_new_tokens")


@pytest.mark.parametrize("start,want_prompt", [(None, False), (-1, False), (0, True), (2, True)])
def test_generate_logprob_start_len(http, start, want_prompt):
    ids = [5, 6, 7, 8, 9]
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 3}}
    if start is not None:
        body["logprob_start_len"] = start
    m = http.post("/generate", json=body).json()["meta_info"]
    assert len(m["output_token_logprobs"]) == 3 and len(m["output_top_logprobs"]) == 3
    assert all(len(top) == 2 and all(len(x) == 3 for x in top) for top in m["output_top_logprobs"])
    assert ("input_token_logprobs" in m) == want_prompt
    if want_prompt:
        assert [t for _, t, _ in m["input_token_logprobs"]] == ids[start:]
        assert len(m["input_top_logprobs"]) == len(ids) - start
        if start == 0:
            assert m["input_token_logprobs"][0][0] is None and m["input_top_logprobs"][0] is None
        assert all(x is not None for x, _, _ in m["input_token_logprobs"][1 if start == 0 else 0:])
