"""Front operations against the fake engine: API key, body size limit, /load, restart counter,
and the CLI side of the new flags."""

from __future__ import annotations

import hmac

import httpx
import pytest

from common import auth
from common.args import ArgError, ServerArgs
from common.serve_cli import parse_server_args
from tests.unit.front_harness import MODEL, assert_error, start_stack

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed():
    s = start_stack(api_key=KEY, max_request_body_bytes=4096)
    yield s
    s.close()


def test_key_required_on_the_api_not_on_probes(keyed):
    with httpx.Client(base_url=keyed.base_url, timeout=10) as c:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Token {KEY}"},
                        {"Authorization": "Bearer"}, {"Authorization": f"Bearer {KEY}x"}):
            for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                                 ("GET", f"/v1/models/{MODEL}"), ("POST", "/generate"), ("POST", "/detokenize"),
                                 ("POST", "/flush_cache"), ("GET", "/health_generate"), ("GET", "/server_info"),
                                 ("POST", "/tokenize")):
                r = c.request(method, path, json={"prompt": "x"}, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                err = r.json()["error"]
                assert err["type"] == "AuthenticationError" and err["code"] == 401 and err["param"] is None
                assert r.headers["www-authenticate"] == "Bearer"
        ok = {"Authorization": f"Bearer {KEY}"}
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=ok).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                      headers={"authorization": f"bearer {KEY}"}).status_code == 200  # scheme is case-insensitive
        for path in ("/health", "/metrics", "/load"):
            assert c.get(path).status_code == 200
        assert c.get("/server_info", headers=ok).json()["api_key"] == "<redacted>"


def test_constant_time_compare_is_used(monkeypatch):
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    stack = start_stack(api_key=KEY)
    try:
        r = httpx.get(stack.base_url + "/v1/models", headers={"Authorization": "Bearer guess"})
        assert r.status_code == 401 and calls == [(b"guess", KEY.encode())]
    finally:
        stack.close()


def test_metrics_require_key():
    stack = start_stack(api_key=KEY, metrics_require_key=True)
    try:
        with httpx.Client(base_url=stack.base_url, timeout=10) as c:
            for path in ("/health", "/metrics", "/load"):
                assert c.get(path).status_code == 401
                assert c.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        stack.close()


def test_body_limit_413(keyed):
    ok = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    big = b'{"prompt": "' + b"a" * 5000 + b'"}'
    with httpx.Client(base_url=keyed.base_url, timeout=10) as c:
        r = c.post("/v1/completions", content=big, headers=ok)
        assert r.status_code == 413 and "retry-after" not in r.headers
        err = r.json()["error"]
        assert err["code"] == 413 and "--max-request-body-bytes" in err["message"] and set(err) >= {"type", "param"}

        def chunked():  # no Content-Length: counted while it streams in
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]

        r = c.post("/v1/chat/completions", content=chunked(), headers=ok)
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        assert c.post("/v1/completions", json={"prompt": "a" * 100, "max_tokens": 2},
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_restart_counter_and_counts_reset():
    stack = start_stack()
    try:
        with httpx.Client(base_url=stack.base_url, timeout=10) as c:
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
            stack.fake.send_dead("worker process died (exit code -9); restarting the engine")
            assert stack.fake.wait_for(lambda: c.get("/health").status_code == 503)
            assert "restarting" in c.post("/v1/completions", json={"prompt": "x"}).json()["error"]["message"]
            stack.fake.generate_count = 0  # a fresh engine has read nothing yet
            stack.fake.send_info()
            assert stack.fake.wait_for(lambda: c.get("/health").status_code == 200)
            assert 'tandem:engine_restarts_total{model_name="fake-model"} 1.0' in c.get("/metrics").text
            assert stack.engine.num_waiting == 0
    finally:
        stack.close()


def test_ops_flags(monkeypatch):
    assert parse_server_args([]).shutdown_timeout == 30.0
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    args = parse_server_args([])
    assert args.api_key == "from-env" and "from-env" not in repr(args)
    assert parse_server_args(["--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("TANDEM_API_KEY")
    for argv, flag in ((["--metrics-require-key"], "--metrics-require-key"), (["--api-key", " "], "--api-key"),
                       (["--max-request-body-bytes", "0"], "--max-request-body-bytes"),
                       (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
                       (["--max-engine-restarts", "-1"], "--max-engine-restarts"),
                       (["--transport", "tcp", "--curve-keys-dir", "/nonexistent"], "--curve-keys-dir")):
        with pytest.raises(ArgError, match=flag):
            parse_server_args(argv)


def test_overlap_depth_flag():
    assert parse_server_args([]).step_depth == 3  # the default (docs/decisions/overlap.md)
    assert parse_server_args(["--overlap-depth", "2"]).step_depth == 2
    assert parse_server_args(["--disable-overlap-schedule"]).step_depth == 1
    assert parse_server_args(["--overlap-depth", "3", "--disable-overlap-schedule"]).step_depth == 1
    assert parse_server_args(["--overlap-depth", "1"]).step_depth == 1
    for bad in ("0", "4"):
        with pytest.raises(ArgError, match="--overlap-depth"):
            parse_server_args(["--overlap-depth", bad])


def test_n_choices_may_use_free_slots():
    """An idle engine with 4 free slots and --max-queued-requests 1 takes n=4 (all start at
    once); n beyond running + queued can never fit: 400 naming n."""
    stack = start_stack(max_queued_requests=1)
    try:
        stack.fake.max_running = 4
        stack.fake.send_info()
        assert stack.fake.wait_for(lambda: stack.engine.info.max_running_requests == 4)
        with httpx.Client(base_url=stack.base_url, timeout=10) as c:
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 5})
            assert r.status_code == 200 and len(r.json()["choices"]) == 5
            assert stack.fake.wait_for(lambda: stack.engine.num_waiting == 0)  # the stats caught up
            assert_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 6}), 400, "n")
    finally:
        stack.close()


def test_admission_estimate_counts_slots_that_free_within_a_step():
    """The waiting estimate behind --max-queued-requests, on the scheduler's report shapes
    (4 slots): a slot held by a finished request (released after its last in-flight step) and a
    finish seen since the report both make room; free slots beside a queue (KV-bound) do not."""
    from proto.messages import EngineInfo, SchedulerStats
    from proto.transport import ipc_endpoints
    from tokenizer_proc.engine_client import EngineClient
    from tokenizer_proc.metrics import Metrics

    args = ServerArgs(model_path=".", max_queued_requests=4)
    engine = EngineClient(args, ipc_endpoints("/nonexistent"), Metrics("m", None))
    try:
        engine.info = EngineInfo(max_context=64, vocab_size=10, page_size=16, num_pages=64, max_running_requests=4,
                                 device="cpu", dtype="float32", architecture="X")

        def report(running, waiting, held, received=8):
            engine.sent_generate = received
            engine.last_stats = SchedulerStats(num_running=running, num_waiting=waiting, kv_pages_used=1,
                                               kv_pages_total=64, requests_received=received, num_slots_held=held)
            engine.finished_since_stats = 0

        report(4, 4, 4)  # full: slots and queue
        assert engine._waiting_with(1) == 5
        engine.finished_since_stats = 1  # one ended after the report: its slot goes to a waiting one
        assert engine._waiting_with(1) == 4
        report(3, 4, 4)  # one slot held by a finished request: free within a step
        assert engine._waiting_with(1) == 4
        report(3, 4, 3)  # a free slot and still a queue: KV pages are the limit
        assert engine._waiting_with(1) == 5
        report(2, 0, 2)  # idle slots take the newcomers first
        assert engine._waiting_with(2) == 0 and engine._waiting_with(3) == 1
        engine.sent_generate += 1  # one in transit
        assert engine._waiting_with(2) == 1
    finally:
        engine.ctx.term()


def test_unreachable_scheduler_fails_the_request_and_marks_the_engine_dead():
    """A requests channel that refuses frames (a tcp:// scheduler with other keys): the submit
    answers 503 naming why, leaves no state behind, and the engine reads as dead."""
    from proto.transport import ChannelRefused, ipc_endpoints
    from tokenizer_proc.engine_client import DEAD, READY, EngineClient
    from tokenizer_proc.metrics import Metrics
    from tokenizer_proc.request_state import RequestState, StopConfig
    from proto.messages import EngineInfo, SamplingParams
    from tokenizer_proc.errors import APIError

    class Decoder:  # the states end with an error: nothing to detokenize
        def decode(self, ids, skip_special_tokens=True):
            return ""

    class Refusing:
        def send_nowait(self, msg):
            raise ChannelRefused("requests channel tcp://10.0.0.2:7001: 5 CURVE handshake(s) in a row failed")

        def close(self):
            pass

    engine = EngineClient(ServerArgs(model_path="."), ipc_endpoints("/nonexistent"), Metrics("m", None))
    try:
        engine.info = EngineInfo(max_context=64, vocab_size=10, page_size=16, num_pages=64, max_running_requests=4,
                                 device="cpu", dtype="float32", architecture="X")
        engine.phase, engine.requests = READY, Refusing()
        states = [RequestState(f"r{i}", i, [1, 2], SamplingParams(max_new_tokens=2), StopConfig(), Decoder())
                  for i in range(2)]
        with pytest.raises(APIError) as err:
            engine.submit(states)
        assert err.value.status == 503 and "CURVE handshake" in str(err.value)
        assert engine.phase == DEAD and engine.states == {}
    finally:
        engine.ctx.term()
