"""Start-up, readiness, overload, engine death and graceful shutdown of the HTTP front."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from common.args import ServerArgs
from proto.messages import AbortReq, Shutdown
from proto.transport import ipc_endpoints, make_run_dir
from tests.unit.fake_engine import FakeEngine
from tests.unit.front_harness import MODEL, start_stack
from tests.unit.front_tok import shared_tokenizer_dir
from tokenizer_proc.main import _amain
from tokenizer_proc.tokenizer import TextTokenizer


class Background:
    """Run one HTTP call in a thread; ``result()`` returns (status, body text)."""

    def __init__(self, base_url: str, path: str, body: dict):
        self.out: tuple[int, str] | None = None
        self.thread = threading.Thread(target=self._run, args=(base_url, path, body), daemon=True)
        self.thread.start()

    def _run(self, base_url: str, path: str, body: dict) -> None:
        with httpx.Client(base_url=base_url, timeout=30) as c:
            r = c.post(path, json=body)
            self.out = (r.status_code, r.text)

    def result(self, timeout: float = 15) -> tuple[int, str]:
        self.thread.join(timeout)
        assert self.out is not None, "request did not finish"
        return self.out


def sse_payloads(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_not_ready_until_engine_info_and_warmup():
    stack = start_stack(wait_ready=False, send_info=False)
    try:
        with httpx.Client(base_url=stack.base_url, timeout=10) as c:
            r = c.get("/health")
            assert r.status_code == 503
            r = c.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == 503
            stack.fake.send_info()
            assert stack.front.ready.wait(10) and stack.front.statuses == [("ready", None)]
            assert c.get("/health").status_code == 200
            warmups = [m for m in stack.fake.received if hasattr(m, "params")]
            assert warmups and warmups[0].params.max_new_tokens == 2 and warmups[0].params.temperature == 0.0
    finally:
        stack.close()


def test_overload_counts_waiting_not_running():
    """--max-queued-requests 2: one running + two waiting are admitted, the next gets 503."""
    stack = start_stack(max_queued_requests=2)
    try:
        stack.fake.paused, stack.fake.max_running = True, 1
        stack.fake.send_info()
        assert stack.fake.wait_for(lambda: stack.engine.info.max_running_requests == 1)
        held = [Background(stack.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 3})]
        assert stack.fake.wait_for(lambda: stack.engine.num_running == 1 and stack.engine.num_waiting == 0)
        held += [Background(stack.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 3}) for _ in range(2)]
        assert stack.fake.wait_for(lambda: stack.engine.num_inflight == 3)
        with httpx.Client(base_url=stack.base_url, timeout=10) as c:
            assert stack.fake.wait_for(lambda: c.get("/load").json()["num_requests_waiting"] == 2)
            load = c.get("/load").json()
            assert load["num_requests_running"] == 1 and load["server_load"] == 3 and load["max_queued_requests"] == 2
            r = c.post("/v1/completions", json={"prompt": "x", "n": 1})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert "overloaded" in err["message"] and err["code"] == 503 and err["type"] == "ServiceUnavailableError"
            assert 'tandem:request_rejected_total{model_name="fake-model",reason="overload"} 1.0' in c.get("/metrics").text
        stack.fake.paused = False
        assert all(b.result()[0] == 200 for b in held)
    finally:
        stack.close()


def test_overload_burst_never_overshoots():
    """A burst arrives faster than the scheduler's stats: requests in transit count as waiting,
    so the engine never holds more than running + N; every request gets 200 or 503."""
    stack = start_stack(max_queued_requests=4)
    try:
        stack.fake.paused, stack.fake.max_running = True, 2
        stack.fake.send_info()  # the engine's slot count, as the front uses it for admission
        assert stack.fake.wait_for(lambda: stack.engine.info.max_running_requests == 2)
        burst = [Background(stack.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 2}) for _ in range(24)]
        # Every request of the burst was either refused or is held by the paused engine.
        assert stack.fake.wait_for(lambda: sum(b.out is not None for b in burst) + stack.engine.num_inflight == 24,
                                   timeout=20)
        # Everything the front sent has landed (not a fixed sleep: slow under load).
        assert stack.fake.wait_for(lambda: stack.fake.generate_count == stack.engine.sent_generate)
        assert len(stack.fake.running) == 2 + 4  # exactly the free slots plus the queue
        stack.fake.paused = False
        codes = [b.result()[0] for b in burst]
        assert set(codes) <= {200, 503} and codes.count(200) == 6
    finally:
        stack.close()


def test_closed_loop_at_capacity_is_never_refused():
    """2 slots + --max-queued-requests 2, and 4 clients that each send their next request the
    moment the last one ended: never more than running + N in the engine, so never a 503, even
    though the scheduler's stats lag (every 50 ms) behind the finishes the front has seen."""
    stack = start_stack(max_queued_requests=2)
    try:
        stack.fake.max_running = 2
        stack.fake.send_info()
        assert stack.fake.wait_for(lambda: stack.engine.info.max_running_requests == 2)
        codes: list[int] = []
        peak = [0]

        def client():
            with httpx.Client(base_url=stack.base_url, timeout=10) as c:
                deadline = time.monotonic() + 1.5
                while time.monotonic() < deadline:
                    codes.append(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code)
                    peak[0] = max(peak[0], len(stack.fake.running))

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert codes and set(codes) == {200}, f"{codes.count(503)} of {len(codes)} refused at capacity"
        assert peak[0] <= 4
    finally:
        stack.close()


def test_engine_dead_fails_inflight_and_health():
    stack = start_stack()
    try:
        stack.fake.paused = True
        plain = Background(stack.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 3})
        streamed = Background(stack.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True})
        assert stack.fake.wait_for(lambda: stack.engine.num_inflight == 2)
        stack.fake.send_dead("worker process died (exit code -9)")
        status, body = plain.result()
        assert status == 503 and "engine is dead" in json.loads(body)["error"]["message"]
        status, body = streamed.result()
        events = sse_payloads(body)
        assert status == 200 and json.loads(events[-2])["error"]["code"] == 503 and events[-1] == "[DONE]"
        with httpx.Client(base_url=stack.base_url, timeout=10) as c:
            assert c.get("/health").status_code == 503
            assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 503
    finally:
        stack.close()


def test_engine_restart_after_death():
    stack = start_stack()
    try:
        stack.fake.send_dead("worker died")
        with httpx.Client(base_url=stack.base_url, timeout=10) as c:
            assert stack.fake.wait_for(lambda: c.get("/health").status_code == 503)
            stack.fake.send_info()  # a restarted engine announces itself again
            assert stack.fake.wait_for(lambda: c.get("/health").status_code == 200)
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        stack.close()


def test_drain_fails_stragglers_after_timeout():
    stack = start_stack(shutdown_timeout=1.0)
    try:
        stack.fake.paused = True
        plain = Background(stack.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 3})
        streamed = Background(stack.base_url, "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True})
        assert stack.fake.wait_for(lambda: stack.engine.num_inflight == 2)
        # The probes below must land inside the drain (the listener closes after it): the client
        # is made before the clock starts.
        with httpx.Client(base_url=stack.base_url, timeout=10) as c:
            t0 = time.monotonic()
            stack.front.request_stop()
            assert c.get("/health").status_code == 503
            assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 503
        status, body = plain.result()
        assert status == 503 and "shutting down" in body and time.monotonic() - t0 >= 0.95
        events = sse_payloads(streamed.result()[1])
        assert json.loads(events[-2])["error"]["code"] == 503 and events[-1] == "[DONE]"
        stack.front.join()
        assert stack.front.exit_code == 0
        assert {a.reason for a in stack.fake.of_type(AbortReq)} == {"shutdown"}
        assert stack.fake.of_type(Shutdown)
    finally:
        stack.close()


def test_drain_lets_requests_finish():
    stack = start_stack(shutdown_timeout=5.0)
    try:
        stack.fake.paused = True
        plain = Background(stack.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 3})
        assert stack.fake.wait_for(lambda: stack.engine.num_inflight == 1)
        stack.front.request_stop()
        assert stack.fake.wait_for(lambda: stack.engine.phase == "draining")  # the request finishes in the drain
        stack.fake.paused = False
        status, body = plain.result()
        assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length"
        stack.front.join()
        assert stack.front.exit_code == 0 and stack.fake.of_type(Shutdown)
    finally:
        stack.close()


def test_vllm_metric_aliases():
    stack = start_stack(metrics_compat="vllm")
    try:
        with httpx.Client(base_url=stack.base_url, timeout=10) as c:
            c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            text = c.get("/metrics").text
        for name in ("num_requests_running", "generation_tokens_total", "time_to_first_token_seconds_bucket",
                     "spec_decode_num_drafts_total"):
            assert f"vllm:{name}" in text and f"tandem:{name}" in text
        assert "_created" not in text
    finally:
        stack.close()


# ---------------------------------------------------------------------- start-up failures


def _start_once(args: ServerArgs, endpoints, fake_setup=None) -> tuple[int, list]:
    statuses: list = []
    code = asyncio.run(asyncio.wait_for(_amain(args, endpoints, lambda k, d: statuses.append((k, d))), 20))
    return code, statuses


def test_startup_errors_are_reported(tmp_path):
    endpoints = ipc_endpoints(make_run_dir())
    args = ServerArgs(model_path=str(tmp_path), port=0, log_level="warning")
    code, statuses = _start_once(args, endpoints)
    assert code == 1 and statuses[0][0] == "error" and "tokenizer.json" in statuses[0][1]

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args = ServerArgs(model_path=shared_tokenizer_dir("chatml"), port=busy.getsockname()[1], log_level="warning")
        code, statuses = _start_once(args, endpoints)
    assert code == 1 and "cannot listen" in statuses[0][1]


@pytest.mark.parametrize("failure", ["dead", "warmup"])
def test_engine_failure_during_startup(failure):
    run_dir = make_run_dir()
    endpoints = ipc_endpoints(run_dir)
    tok = TextTokenizer(shared_tokenizer_dir("chatml"))
    fake = FakeEngine(endpoints, tok.vocab_size, tok.eos_id)
    if failure == "dead":
        fake.send_dead("worker failed to load the model")
    else:
        fake.error_token = tok.bos_id  # the warm-up prompt starts with BOS
    fake.start(send_info=failure != "dead")
    try:
        args = ServerArgs(model_path=shared_tokenizer_dir("chatml"), port=0, log_level="warning")
        code, statuses = _start_once(args, endpoints)
    finally:
        fake.stop()
    assert code == 1 and statuses[-1][0] == "error"
    assert ("worker failed to load" if failure == "dead" else "warm-up request failed") in statuses[-1][1]


# ---------------------------------------------------------------------- the real process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_process_entry_point_ready_and_sigterm():
    """tokenizer_proc.main.run in a spawned process: status pipe, uvloop, SIGTERM -> Shutdown, exit 0."""
    from tokenizer_proc.main import run

    run_dir = make_run_dir()
    endpoints = ipc_endpoints(run_dir)
    tok = TextTokenizer(shared_tokenizer_dir("chatml"))
    fake = FakeEngine(endpoints, tok.vocab_size, tok.eos_id).start()
    port = _free_port()
    args = ServerArgs(model_path=shared_tokenizer_dir("chatml"), served_model_name=MODEL, port=port,
                      log_level="warning", shutdown_timeout=0.5)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run, args=(args, endpoints, child))
    proc.start()
    try:
        assert parent.poll(60), "no status from the front process"
        assert parent.recv() == ("ready", None)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(20)
        assert proc.exitcode == 0
        assert fake.wait_for(lambda: fake.of_type(Shutdown))
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        fake.stop()
