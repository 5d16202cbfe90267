"""The router's HTTP behaviour against fake engines served in threads (no model, fast).

Retries before the first byte, SSE error after it, ejection on a refused connection, the
circuit breaker, client disconnects, the /workers API, model-aware routing and /metrics.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.helpers.fake_upstream import FakeEngine, ServerThread, Stack, until
from tests.helpers.server import free_port, post_then_leave

@pytest.fixture
def stack():
    s = Stack(2)
    yield s
    s.stop()


def sse_payloads(r: httpx.Response) -> list:
    return [p if p == "[DONE]" else json.loads(p) for p in
            (line[6:] for line in r.iter_lines() if line.startswith("data: "))]


def test_retry_on_503_moves_to_another_worker_and_propagates_request_id(stack):
    stack.fakes[0].fail_next = stack.fakes[1].fail_next = 1  # whichever is tried first fails once
    r = httpx.post(stack.url + "/v1/completions", json={"prompt": "hi"}, headers={"x-request-id": "rid-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "rid-1"
    seen = [s for f in stack.fakes for s in f.seen]
    # First try fails, the retry avoids that worker and fails too, the third try succeeds.
    assert len(seen) == 3 and all(h["x-request-id"] == "rid-1" for _, h, _ in seen)
    text = httpx.get(stack.url + "/metrics").text
    assert 'tandem_router_retries_total{route="/v1/completions"} 2.0' in text


def test_retries_exhausted_returns_the_engines_answer_in_bounded_time():
    s = Stack(2, "--retry-max-retries", "3", "--disable-circuit-breaker")
    try:
        for f in s.fakes:
            f.status = 503
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert time.monotonic() - t0 < 5
        assert sum(len(f.seen) for f in s.fakes) == 4
        assert "tandem_router_retries_exhausted_total" in httpx.get(s.url + "/metrics").text
    finally:
        s.stop()


def test_client_errors_are_not_retried(stack):
    for f in stack.fakes:
        f.status = 400
    r = httpx.post(stack.url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 400 and sum(len(f.seen) for f in stack.fakes) == 1


def test_stream_broken_after_first_byte_ends_with_sse_error(stack):
    for f in stack.fakes:
        f.break_after = 2
    with httpx.stream("POST", stack.url + "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_payloads(r)
    assert [e["choices"][0]["text"] for e in events[:2]] == ["hi:0", "hi:1"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 502
    assert sum(len(f.seen) for f in stack.fakes) == 1  # no retry after the first byte
    assert 'tandem_router_stream_errors_total{route="/v1/completions"} 1.0' in httpx.get(stack.url + "/metrics").text


def test_stream_passes_chunks_through_in_order(stack):
    with httpx.stream("POST", stack.url + "/generate", json={"text": "abc", "stream": True}) as r:
        events = sse_payloads(r)
    assert [e["choices"][0]["text"] for e in events[:-1]] == [f"abc:{i}" for i in range(4)]
    assert events[-1] == "[DONE]"


def test_refused_connection_ejects_at_once_and_retries_elsewhere():
    dead_url = f"http://127.0.0.1:{free_port()}"
    s = Stack(1, "--health-check-interval-secs", "30", "--policy", "round_robin")
    try:
        r = httpx.post(s.url + "/workers", json={"url": dead_url})
        assert r.status_code == 201 and not r.json()["is_healthy"]
        dead = s.router.registry.find(dead_url)
        dead.healthy = dead.ever_healthy = True  # as if it had just died
        for i in range(4):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": f"p{i}"})
            assert r.status_code == 200
        assert not dead.healthy
        text = httpx.get(s.url + "/metrics").text
        assert f'tandem_router_worker_requests_total{{outcome="connect_error",worker="{dead_url}"}} 1.0' in text
    finally:
        s.stop()


def test_circuit_breaker_opens_and_recovers():
    s = Stack(2, "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "1.5", "--cb-success-threshold", "1")
    try:
        bad, good = s.fakes
        bad.status = 500
        for i in range(6):
            assert httpx.post(s.url + "/v1/completions", json={"prompt": f"x{i}"}).status_code == 200
        w_bad = s.router.registry.all()[0]
        assert w_bad.breaker.state == "open"
        assert f'tandem_router_worker_cb_state{{worker="{w_bad.url}"}} 1.0' in httpx.get(s.url + "/metrics").text
        tried = len(bad.seen)
        for i in range(4):
            httpx.post(s.url + "/v1/completions", json={"prompt": f"y{i}"})
        assert len(bad.seen) == tried  # open: no traffic
        bad.status = 200
        time.sleep(1.5)
        until(lambda: httpx.post(s.url + "/v1/completions", json={"prompt": "z"}) and w_bad.breaker.state == "closed")
    finally:
        s.stop()


def test_client_disconnect_aborts_upstream_stream(stack):
    for f in stack.fakes:
        f.chunks, f.chunk_delay_s = 1000, 0.02
    with httpx.stream("POST", stack.url + "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        it = r.iter_lines()
        next(it)
    until(lambda: sum(f.disconnects for f in stack.fakes) == 1)
    until(lambda: all(w.inflight == 0 for w in stack.router.registry.all()))


def test_client_gone_before_a_json_answer_aborts_upstream(stack):
    """The router waits on the upstream for the client; a client that leaves first takes the
    upstream request down with it (the engine frees its KV) and is counted as a 499."""
    for f in stack.fakes:
        f.json_delay_s = 30.0
    post_then_leave(stack.url, "/v1/completions", {"prompt": "hi"},
                    until=lambda: sum(len(f.seen) for f in stack.fakes) == 1)  # upstream has it, client leaves
    until(lambda: sum(f.disconnects for f in stack.fakes) == 1)
    until(lambda: all(w.inflight == 0 for w in stack.router.registry.all()))
    text = httpx.get(stack.url + "/metrics").text
    assert 'tandem_router_client_disconnects_total{route="/v1/completions"} 1.0' in text
    assert 'tandem_router_requests_total{route="/v1/completions",status="499"} 1.0' in text
    for f in stack.fakes:
        f.json_delay_s = 0.0
    assert httpx.post(stack.url + "/v1/completions", json={"prompt": "hi"}).status_code == 200  # still serving


def test_body_over_the_limit_is_413_before_forwarding():
    s = Stack(1, "--max-request-body-bytes", "1000")
    try:
        big = json.dumps({"prompt": "a" * 2000}).encode()

        def chunked():  # no Content-Length: counted as it streams in
            for i in range(0, len(big), 300):
                yield big[i:i + 300]

        for content in (big, chunked()):
            r = httpx.post(s.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == 413
            assert "--max-request-body-bytes" in r.json()["error"]["message"]
        assert not s.fakes[0].seen
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "a" * 100}).status_code == 200
    finally:
        s.stop()


def test_wrong_method_on_a_proxied_route_is_405(stack):
    r = httpx.get(stack.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == 405 and not any(f.seen for f in stack.fakes)


def test_no_worker_means_503_and_probes(stack):
    for f in stack.fakes:
        f.healthy = False
    until(lambda: httpx.get(stack.url + "/health").status_code == 503)
    assert httpx.get(stack.url + "/liveness").status_code == 200
    assert httpx.get(stack.url + "/readiness").status_code == 503
    r = httpx.post(stack.url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and "no healthy worker" in r.text
    for f in stack.fakes:
        f.healthy = True
    until(lambda: httpx.get(stack.url + "/readiness").status_code == 200)


def test_workers_api(stack):
    base = stack.url
    assert httpx.post(base + "/workers", json={"url": "not a url"}).status_code == 400
    bad_json = httpx.post(base + "/workers", content=b"{oops", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400
    assert httpx.post(base + "/workers", json={}).status_code == 400
    extra = ServerThread(FakeEngine("m").app)
    try:
        r = httpx.post(base + "/workers", json={"url": extra.url + "/"})
        assert r.status_code == 201 and r.json()["url"] == extra.url and r.json()["is_healthy"]
        assert httpx.post(base + f"/add_worker?url={extra.url}").status_code == 200  # already there
        listed = httpx.get(base + "/workers").json()
        assert listed["total"] == 3 and listed["healthy"] == 3
        wid = r.json()["id"]
        assert httpx.get(base + f"/workers/{wid}").json()["url"] == extra.url
        assert httpx.delete(base + f"/workers/{wid}").status_code == 200
        assert httpx.delete(base + f"/workers/{wid}").status_code == 404
        assert httpx.get(base + "/list_workers").json()["total"] == 2
        assert httpx.post(base + f"/add_worker?url={extra.url}").status_code == 201
        assert httpx.post(base + f"/remove_worker?url={extra.url}").status_code == 200
    finally:
        extra.stop()


def test_models_are_aggregated_and_requests_follow_their_model():
    s = Stack(2, names=["alpha", "beta"])
    try:
        until(lambda: all(w.models for w in s.router.registry.all()))
        ids = [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]]
        assert ids == ["alpha", "beta"]
        for _ in range(4):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "model": "beta"})
            assert r.json()["server"] == "beta"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                              "model": "gamma"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        assert httpx.post(s.url + "/tokenize", json={"prompt": "ab"}).json()["tokens"] == [97, 98]
        assert httpx.get(s.url + "/server_info").json()["server"] in ("alpha", "beta")  # any worker answers
    finally:
        s.stop()


def test_engine_load_is_polled_and_exported(stack):
    f = stack.fakes[0]
    f.running, f.waiting, f.kv = 3, 2, 0.5
    w = stack.router.registry.all()[0]
    until(lambda: w.load() == 5)
    body = httpx.get(stack.url + "/workers").json()["workers"][0]
    assert body["num_running_reqs"] == 3 and body["num_waiting_reqs"] == 2 and body["kv_cache_usage_perc"] == 0.5
    text = httpx.get(stack.url + "/metrics").text
    for name in ("tandem_router_worker_load", "tandem_router_worker_num_requests_waiting",
                 "tandem_router_worker_kv_cache_usage_perc", "tandem_router_worker_healthy",
                 "tandem_router_workers", "tandem_router_cache_tree_size_chars"):
        assert f"\n{name}{{" in text, name
    assert "_created" not in text
    httpx.post(stack.url + "/v1/completions", json={"prompt": "hi", "stream": True})
    text = httpx.get(stack.url + "/metrics").text
    for name in ("tandem_router_requests_total", "tandem_router_request_duration_seconds_bucket",
                 "tandem_router_ttft_seconds_bucket"):
        assert f"\n{name}{{" in text, name


def test_stream_cut_before_its_first_byte_is_retried_elsewhere():
    s = Stack(2, "--policy", "round_robin")
    try:
        s.fakes[0].break_after = 0  # accepts, sends headers, dies before any event
        for i in range(2):  # round robin: one of these starts on the broken engine
            with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": f"p{i}", "stream": True}) as r:
                events = sse_payloads(r)
            assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
            assert {e["server"] for e in events[:-1]} == {"m"} and len(events) == 5
        assert len(s.fakes[0].seen) >= 1 and len(s.fakes[1].seen) == 2
    finally:
        s.stop()


def test_engine_without_load_route_is_read_from_its_prometheus_gauges(stack):
    f = stack.fakes[1]
    f.vllm_like = True
    f.running, f.waiting, f.kv = 4, 7, 0.25
    w = stack.router.registry.all()[1]
    until(lambda: w.load_source == "metrics" and w.load() == 11)
    assert w.kv_usage == 0.25


@pytest.mark.parametrize("keyed_ops", [False, True])
def test_api_key_guards_the_router_and_reaches_the_engines(monkeypatch, keyed_ops):
    """tandem serve --dp-size N --api-key K: the router answers /workers, /flush_cache,
    /v1/models itself, so it checks the key too (adding a worker would send traffic anywhere),
    and it sends the key on its own calls to the keyed engines (else /v1/models is empty, and
    with --metrics-require-key no engine ever looks healthy)."""
    key = "rk-123"
    monkeypatch.setenv("TANDEM_API_KEY", key)  # how tandem/dp.py hands it over
    s = Stack(2, *(["--metrics-require-key"] if keyed_ops else []), names=["alpha", "beta"])
    for f in s.fakes:
        f.api_key, f.keyed_ops = key, keyed_ops
    ok = {"Authorization": f"Bearer {key}"}
    try:
        until(lambda: all(w.healthy and w.models for w in s.router.registry.all()))
        for headers in ({}, {"Authorization": "Bearer nope"}):
            for method, path in (("GET", "/workers"), ("POST", "/workers"), ("POST", "/add_worker"),
                                 ("DELETE", "/workers/worker-0"), ("POST", "/flush_cache"), ("GET", "/v1/models"),
                                 ("GET", "/server_info"), ("GET", "/get_loads"), ("POST", "/v1/completions")):
                r = httpx.request(method, s.url + path, json={"url": "http://127.0.0.1:9", "prompt": "p"},
                                  headers=headers)
                err = r.json()["error"]
                assert r.status_code == 401 and err["type"] == "AuthenticationError", (method, path, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(s.url + "/workers", headers=ok).json()["total"] == 2  # nothing was added or removed
        assert not any(f.seen for f in s.fakes)  # nor forwarded (the router's own key would have let it in)
        for path in ("/health", "/metrics", "/readiness", "/liveness"):
            assert httpx.get(s.url + path).status_code == (401 if keyed_ops else 200), path
            assert httpx.get(s.url + path, headers=ok).status_code == 200, path
        ids = [m["id"] for m in httpx.get(s.url + "/v1/models", headers=ok).json()["data"]]
        assert ids == ["alpha", "beta"]
        assert httpx.get(s.url + "/server_info", headers=ok).json()["server"] in ("alpha", "beta")
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "p"}, headers=ok)
        assert r.status_code == 200 and r.json()["server"] in ("alpha", "beta")
    finally:
        s.stop()
