"""Small HTTP helpers shared by the test_e2e_api*.py files: SSE reading and /metrics parsing."""

from __future__ import annotations

import json
import time

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families


def one_thread():
    """HF references on one thread: on a busy 2-core box, two threads are 50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    return before


def post(url: str, body: dict, timeout: float = 60.0) -> dict:
    r = httpx.post(url, json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, body: dict, timeout: float = 60.0) -> list[dict]:
    """POST with stream=true; the parsed events, checking the SSE framing and the final [DONE]."""
    events, done = [], False
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            assert not done, "event after [DONE]"
            if line == "data: [DONE]":
                done = True
                continue
            events.append(json.loads(line[6:]))
    assert done, "stream did not end with [DONE]"
    assert not any("error" in e for e in events), events
    return events


def metrics(base: str, client: httpx.Client | None = None) -> dict[tuple, float]:
    """{(sample name, frozenset(labels without model_name)): value}."""
    text = (client or httpx).get(base + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


def engine_steps(base: str) -> int:
    """The scheduler's cumulative step count (its last stats, as /server_info reports them)."""
    return httpx.get(base + "/server_info", timeout=10).json()["scheduler_stats"]["steps"]


def stop_server(server) -> None:
    """SIGTERM once the engine is idle (an abort's steps may still be in flight right after a
    test: see test_sigterm_while_generating_exits_0 for the shutdown race that hits), exit 0."""
    try:
        wait_idle(server.url, timeout=3.0)
    except (AssertionError, httpx.HTTPError):
        pass
    code = server.stop()
    with open(server.log_path) as f:
        assert code == 0, f.read()[-4000:]


def wait_idle(base: str, timeout: float = 2.0, idle_kv: float = 0.0) -> float:
    """Seconds until the scheduler reports no running request and idle KV usage (fails after timeout)."""
    with httpx.Client() as client:  # one client for every poll: the timeout is the server's, not ours
        t0 = time.monotonic()
        while True:
            m = metrics(base, client)
            running = metric(m, "tandem:num_requests_running")
            kv = metric(m, "tandem:kv_cache_usage_perc")
            if running == 0 and kv <= idle_kv + 1e-9:
                return time.monotonic() - t0
            assert time.monotonic() - t0 < timeout, f"still busy after {timeout}s: running={running} kv={kv}"
            time.sleep(0.02)
