"""Hostile and malformed requests against a real `tandem serve` (small context, vLLM metric
aliases): every one gets a 4xx with vLLM's error shape, never a 5xx or a 422, and the server stays
healthy. Then a bounded schemathesis run over /openapi.json, asserting no 5xx.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tests.e2e.api_util import metrics, post, stop_server
from tests.helpers.server import Server

CTX = 64
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def srv(ckpts):
    # Bodies up to 64 MiB, so the 10 MB cases below reach the text-length guard (the 8 MiB
    # default body limit, 413, is tested in test_e2e_ops.py).
    # Tool calling on, so the schemathesis run below reaches the tool-call parser path too.
    s = Server(ckpts["gemma4"], "--context-length", str(CTX), "--metrics-compat", "vllm",
               "--max-request-body-bytes", str(64 << 20), "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield ckpts["gemma4"], s
    stop_server(s)


def _nested(depth: int) -> bytes:
    return b'{"prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"


def _j(body) -> bytes:
    return json.dumps(body).encode()


C, CH, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "hi"}]
# (name, path, body bytes, headers, status, param)
BATTERY = [
    ("bad json", C, b'{"prompt": "hi",', JSON, 400, None),
    ("not an object", C, b"[1, 2]", JSON, 400, None),
    ("empty body", C, b"", JSON, 400, None),
    ("NaN literal", C, b'{"prompt": "hi", "temperature": NaN}', JSON, 400, None),
    ("prompt wrong type", C, _j({"prompt": 5}), JSON, 400, "prompt"),
    ("max_tokens wrong type", C, _j({"prompt": "hi", "max_tokens": "many"}), JSON, 400, "max_tokens"),
    ("max_tokens bool", C, _j({"prompt": "hi", "max_tokens": True}), JSON, 400, "max_tokens"),
    ("n fractional", C, _j({"prompt": "hi", "n": 1.5}), JSON, 400, "n"),
    ("negative max_tokens", C, _j({"prompt": "hi", "max_tokens": -1}), JSON, 400, "max_tokens"),
    ("max_tokens 0 without echo", C, _j({"prompt": "hi", "max_tokens": 0}), JSON, 400, "max_tokens"),
    ("chat max_tokens 0", CH, _j({"messages": MSG, "max_tokens": 0}), JSON, 400, "max_tokens"),
    ("temperature -1", C, _j({"prompt": "hi", "temperature": -1}), JSON, 400, "temperature"),
    ("temperature 1e999", C, b'{"prompt": "hi", "temperature": 1e999}', JSON, 400, "temperature"),
    ("top_p 2", C, _j({"prompt": "hi", "top_p": 2}), JSON, 400, "top_p"),
    ("top_p 0", CH, _j({"messages": MSG, "top_p": 0}), JSON, 400, "top_p"),
    ("n 0", C, _j({"prompt": "hi", "n": 0}), JSON, 400, "n"),
    ("huge n", C, _j({"prompt": "hi", "n": 100000}), JSON, 400, "n"),
    ("logprobs 50", C, _j({"prompt": "hi", "logprobs": 50}), JSON, 400, "logprobs"),
    ("top_logprobs 50", CH, _j({"messages": MSG, "logprobs": True, "top_logprobs": 50}), JSON, 400,
     "top_logprobs"),
    ("top_logprobs without logprobs", CH, _j({"messages": MSG, "top_logprobs": 2}), JSON, 400, "top_logprobs"),
    ("seed 2**64", C, _j({"prompt": "hi", "seed": 2**64}), JSON, 400, "seed"),
    ("presence_penalty 3", C, _j({"prompt": "hi", "presence_penalty": 3}), JSON, 400, "presence_penalty"),
    ("repetition_penalty 0", C, _j({"prompt": "hi", "repetition_penalty": 0}), JSON, 400, "repetition_penalty"),
    ("token id out of vocab", C, _j({"prompt": [1, 384]}), JSON, 400, "prompt"),
    ("token id negative", C, _j({"prompt": [[1, -3]]}), JSON, 400, "prompt"),
    ("token id 2**70", C, _j({"prompt": [1, 2**70]}), JSON, 400, "prompt"),
    ("stop_token_ids out of vocab", C, _j({"prompt": "hi", "stop_token_ids": [10**6]}), JSON, 400,
     "stop_token_ids"),
    ("min_tokens over max_tokens", C, _j({"prompt": "hi", "max_tokens": 3, "min_tokens": 10}), JSON, 400,
     "min_tokens"),
    ("chat min_tokens over max_completion_tokens", CH, _j({"messages": MSG, "max_completion_tokens": 3,
                                                          "min_tokens": 5}), JSON, 400, "min_tokens"),
    ("generate min_new_tokens over max_new_tokens", GEN, _j({"text": "hi", "sampling_params": {
        "max_new_tokens": 2, "min_new_tokens": 3}}), JSON, 400, "sampling_params.min_new_tokens"),
    ("empty prompt", C, _j({"prompt": ""}), JSON, 400, "prompt"),
    ("empty prompt list", C, _j({"prompt": []}), JSON, 400, "prompt"),
    ("empty inner list", C, _j({"prompt": [[]]}), JSON, 400, "prompt"),
    ("mixed prompt list", C, _j({"prompt": [1, "a"]}), JSON, 400, "prompt"),
    ("empty stop string", C, _j({"prompt": "hi", "stop": [""]}), JSON, 400, "stop"),
    ("stream_options without stream", C, _j({"prompt": "hi", "stream_options": {"include_usage": True}}), JSON,
     400, "stream_options"),
    ("prompt_logprobs with stream", C, _j({"prompt": "hi", "prompt_logprobs": 1, "stream": True}), JSON, 400,
     "prompt_logprobs"),
    ("logit_bias id outside the vocabulary", C, _j({"prompt": "hi", "logit_bias": {"99999999": 10}}), JSON, 400,
     "logit_bias"),
    ("generate logit_bias id outside the vocabulary", GEN, _j({"text": "hi", "sampling_params": {
        "logit_bias": {"99999999": 1}}}), JSON, 400, "sampling_params.logit_bias"),
    ("logit_bias key not a token id", CH, _j({"messages": [{"role": "user", "content": "x"}],
                                              "logit_bias": {"a": 1}}), JSON, 400, "logit_bias"),
    ("empty messages", CH, _j({"messages": []}), JSON, 400, "messages"),
    ("message without role", CH, _j({"messages": [{"content": "x"}]}), JSON, 400, "messages[0].role"),
    ("user message without content", CH, _j({"messages": [{"role": "user"}]}), JSON, 400, "messages[0].content"),
    ("unknown role", CH, _j({"messages": [{"role": "robot", "content": "x"}]}), JSON, 400, "messages[0].role"),
    ("message not an object", CH, _j({"messages": ["x"]}), JSON, 400, "messages[0]"),
    ("image part", CH, _j({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
     JSON, 400, "messages[0].content[0].type"),
    ("unknown model", C, _j({"prompt": "hi", "model": "gpt-17"}), JSON, 404, "model"),
    ("unknown model chat", CH, _j({"messages": MSG, "model": "gpt-17", "stream": True}), JSON, 404, "model"),
    ("prompt + max_tokens over context", C, _j({"prompt": "hi", "max_tokens": CTX}), JSON, 400, "max_tokens"),
    ("token prompt over context", C, _j({"prompt": list(range(6, 6 + CTX))}), JSON, 400, "max_tokens"),
    ("chat over context", CH, _j({"messages": [{"role": "user", "content": "hi " * 100}]}), JSON, 400, "messages"),
    ("generate over context", GEN, _j({"text": "hi", "sampling_params": {"max_new_tokens": 500}}), JSON, 400,
     "sampling_params.max_new_tokens"),
    ("stream over context", C, _j({"prompt": "hi", "max_tokens": 500, "stream": True}), JSON, 400, "max_tokens"),
    ("text/plain", C, _j({"prompt": "hi"}), {"content-type": "text/plain"}, 400, None),
    ("form encoded", C, b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}, 400, None),
    ("10 MB prompt", C, _j({"prompt": "hi " * 3_500_000}), JSON, 400, "prompt"),
    ("10 MB chat", CH, _j({"messages": [{"role": "user", "content": "x" * 10_000_000}]}), JSON, 400, "messages"),
    ("10 MB generate text", GEN, _j({"text": "y" * 10_000_000}), JSON, 400, "text"),
    ("10 MB tokenize", "/tokenize", _j({"prompt": "z " * 5_000_000}), JSON, 400, "prompt"),
    ("10 MB garbage", C, b"\x00garbage" * 1_250_000, JSON, 400, None),
    ("deeply nested", C, _nested(100_000), JSON, 400, None),
    ("nested 1000", CH, b'{"messages": [{"role": "user", "content": "hi", "x": ' + b"[" * 1000 + b"]" * 1000
     + b"}]}", JSON, 400, None),
    ("non-UTF-8 string", C, b'{"prompt": "\xff\xfe hi"}', JSON, 400, None),
    ("non-UTF-8 bytes", C, b"\xff\xfe\x00\x01", JSON, 400, None),
    ("generate neither text nor ids", GEN, _j({}), JSON, 400, "text"),
    ("generate both", GEN, _j({"text": "a", "input_ids": [1]}), JSON, 400, "text"),
    ("generate n 2", GEN, _j({"text": "a", "sampling_params": {"n": 2}}), JSON, 400, "sampling_params.n"),
    ("generate rid too long", GEN, _j({"text": "a", "rid": "r" * 300}), JSON, 400, "rid"),
    ("tokenize wrong type", "/tokenize", _j({"prompt": 5}), JSON, 400, "prompt"),
    ("detokenize out of vocab", "/detokenize", _j({"tokens": [10**6]}), JSON, 400, "tokens"),
]


def _check_error(r: httpx.Response, status: int, param: str | None, name: str) -> dict:
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    body = r.json()
    err = body["error"]
    assert set(body) == {"error"} and set(err) == {"message", "type", "param", "code"}, name
    assert err["code"] == status and isinstance(err["message"], str) and err["message"], name
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError"), name
    assert err["param"] == param, (name, err)
    return err


def test_error_battery(srv):
    path, s = srv
    with httpx.Client(base_url=s.url, timeout=30) as client:
        for name, url, body, headers, status, param in BATTERY:
            t0 = time.monotonic()
            r = client.post(url, content=body, headers=headers)
            err = _check_error(r, status, param, name)
            assert time.monotonic() - t0 < 5, name  # none of these may stall the front
            if "context" in name:
                assert f"maximum context length is {CTX} tokens" in err["message"], err
        for method, url, status in [("GET", C, 405), ("PUT", CH, 405), ("GET", "/v1/nope", 404)]:
            r = client.request(method, url)
            assert r.status_code == status and r.json()["error"]["code"] == status
        assert client.get("/health").status_code == 200
        r = post(s.url + C, {"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert r["usage"]["completion_tokens"] == 3
        load = client.get("/load").json()
        assert load["server_load"] == 0 and {"num_running_reqs", "num_waiting_reqs", "kv_cache_usage_perc"} <= set(load)


def test_errors_through_openai_client(srv):
    path, s = srv
    client = OpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=30)
    with pytest.raises(NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model=path, messages=MSG, max_tokens=CTX, stream=True)
    assert f"{CTX} tokens" in str(e.value)
    with pytest.raises(BadRequestError):
        client.completions.create(model=path, prompt="hi", temperature=-1)
    r = client.chat.completions.create(model=path, messages=MSG, max_tokens=2)
    assert r.usage.completion_tokens <= 2


def test_vllm_metric_aliases(srv):
    path, s = srv
    post(s.url + C, {"prompt": "hi", "max_tokens": 2})
    time.sleep(0.1)
    m = metrics(s.url)
    names = {name for name, _ in m}
    tandem = {n for n in names if n.startswith("tandem:")}
    assert tandem and {"vllm:" + n[len("tandem:"):] for n in tandem} == {n for n in names if n.startswith("vllm:")}
    for (name, labels), value in m.items():
        if name.startswith("tandem:"):
            assert m[("vllm:" + name[len("tandem:"):], labels)] == value, name
    assert m[("vllm:generation_tokens_total", frozenset())] >= 2
    assert "_created" not in httpx.get(s.url + "/metrics").text


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_tools_request_without_a_call_is_the_models_text(srv):
    """With the tool-call flags, a tools request the tiny model answers without a call gets the
    model's text as content (hermes decodes with special tokens kept: so does the plain request
    compared with), the same finish_reason, no tool_calls; streamed the same. required is constrained
    decoding (a JSON array of calls, here cut by max_tokens: its text is the content)."""
    path, s = srv
    client = OpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=30)
    kw = dict(model=path, messages=MSG, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kw, extra_body={"skip_special_tokens": False}).choices[0]
    r = client.chat.completions.create(**kw, tools=TOOLS).choices[0]
    assert plain.message.content and plain.finish_reason in ("stop", "length")
    assert (r.message.content, r.message.tool_calls, r.finish_reason) == (
        plain.message.content, None, plain.finish_reason)
    chunks = list(client.chat.completions.create(**kw, tools=TOOLS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.message.content
    assert chunks[-1].choices[0].finish_reason == plain.finish_reason
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    forced = client.chat.completions.create(**kw, tools=TOOLS, tool_choice="required").choices[0]
    assert forced.message.tool_calls or forced.message.content.lstrip().startswith("[")


def _cap_schema(node) -> None:
    """Bound the run's cost: at most 2 choices and 3 prompts per request."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "n" and isinstance(value, dict):
                for opt in value.get("anyOf", [value]):
                    if opt.get("type") == "integer":
                        opt["maximum"] = 2
            if key == "prompt" and isinstance(value, dict):
                for opt in value.get("anyOf", []):
                    if opt.get("type") == "array":
                        opt["maxItems"] = 3
            _cap_schema(value)
    elif isinstance(node, list):
        for value in node:
            _cap_schema(value)


def test_schemathesis_no_server_errors(srv, tmp_path):
    path, s = srv
    schema = httpx.get(s.url + "/openapi.json").json()
    _cap_schema(schema)
    spec = tmp_path / "openapi.json"
    spec.write_text(json.dumps(schema))
    base = [sys.executable, "-m", "schemathesis.cli", "run", str(spec), "--url", s.url, "--checks",
            "not_a_server_error", "--workers", "1", "--seed", "7", "--request-timeout", "20",
            "--suppress-health-check", "all", "--no-shrink"]
    # Negative boundary cases (all 4xx, fast) over every operation, then a bounded fuzz.
    for extra in (["--phases", "coverage", "--mode", "negative"], ["--phases", "fuzzing", "--max-examples", "10"]):
        out = subprocess.run(base + extra, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
        assert int(re.search(r"(\d+) generated", out.stdout).group(1)) > 50, out.stdout[-3000:]
    assert httpx.get(s.url + "/health").status_code == 200


def test_sigterm_while_generating_exits_0(ckpts):
    s = Server(ckpts["gemma4"], "--shutdown-timeout", "0")
    body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(timeout=30) as client, client.stream("POST", s.url + C, json=body) as r:
            lines = r.iter_lines()
            next(lines)
            code = s.stop()
            rest = [line for line in lines if line]
    finally:
        s.stop()  # no-op after the stop above; a failure before it must not leave the server running
    assert rest[-1] == "data: [DONE]" and any('"error"' in line for line in rest)  # failed, not cut off
    assert code == 0, open(s.log_path).read()[-2000:]


def test_burst_beyond_slots(srv):
    """More engine requests than the 64 slots, all finishing in their first step, then more work
    (last in the module: before c780ddd this wedged the scheduler for good)."""
    path, s = srv
    for _ in range(2):
        r = httpx.post(s.url + C, json={"prompt": "hi", "max_tokens": 1, "n": 128}, timeout=20)
        assert r.status_code == 200 and len(r.json()["choices"]) == 128
        assert r.json()["usage"]["completion_tokens"] == 128
        r = httpx.post(s.url + C, json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True}, timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
