"""``tandem router`` in front of three real CPU engines (tiny Llama built in the test).

Order matters inside this module (one set of engines for all of it): correctness first, then
the shared-prefix workload, then /workers changes under load, then SIGKILL of one engine.
Every wait is bounded; every request must end with tokens or an explicit error.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from tests.e2e.api_util import metric, metrics
from tests.helpers.router import RouterProcess
from tests.helpers.server import Server

ROUTER_FLAGS = ("--health-check-interval-secs", "0.3", "--health-failure-threshold", "2",
                "--health-success-threshold", "2", "--load-poll-interval-secs", "0.2",
                "--retry-initial-backoff-ms", "20", "--retry-max-retries", "4", "--cb-timeout-duration-secs", "2")


@pytest.fixture(scope="module")
def stack(ckpts):
    engines = [Server(ckpts["llama"], "--max-running-requests", "8", wait=False) for _ in range(3)]
    try:
        for e in engines:
            e.wait_ready()
        router = RouterProcess([e.url for e in engines], *ROUTER_FLAGS)
    except Exception:
        for e in engines:
            e.stop()
        raise
    yield router, engines
    router.stop()
    for e in engines:
        e.stop()


def _complete(base: str, prompt: str, max_tokens: int = 8, **kw) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    return httpx.post(base + "/v1/completions", json=body, timeout=60.0)


def _sse(base: str, body: dict, headers: dict | None = None, on_first=None) -> tuple[dict, list]:
    """Stream a completion; (response headers, parsed data payloads incl. '[DONE]')."""
    out: list = []
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=60.0) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                payload = line[6:]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
                if on_first is not None and len(out) == 1:
                    on_first(r.headers)
        return dict(r.headers), out


def test_greedy_through_router_equals_engine(stack):
    router, engines = stack
    direct = OpenAI(base_url=engines[0].base_url, api_key="x")
    via = OpenAI(base_url=router.url + "/v1", api_key="x")
    model = direct.models.list().data[0].id
    assert [m.id for m in via.models.list().data] == [model]
    for prompt in ("The quick brown fox", "To be, or not to be", "Once upon a time"):
        a = direct.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        b = via.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert b.choices[0].text == a.choices[0].text
        assert b.usage.completion_tokens == a.usage.completion_tokens == 12
    msgs = [{"role": "user", "content": "The dog sleeps in the sun."}]
    a = direct.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0)
    b = via.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0)
    assert b.choices[0].message.content == a.choices[0].message.content
    # The engine's own errors pass through unchanged.
    bad = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": -3}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
    missing = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "model": "nope"}, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_streaming_passthrough_and_request_id(stack):
    router, engines = stack
    body = {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0,
            "stream_options": {"include_usage": True}}
    headers, events = _sse(router.url, body, headers={"x-request-id": "trace-me-42"})
    assert headers["x-request-id"] == "trace-me-42"
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len(chunks) >= 8  # relayed event by event, not buffered into one
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 16
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == _complete(engines[0].url, body["prompt"], 16).json()["choices"][0]["text"]
    # The openai client reads the relayed stream as it reads an engine's.
    via = OpenAI(base_url=router.url + "/v1", api_key="x")
    got = "".join(c.choices[0].text for c in via.completions.create(
        model=via.models.list().data[0].id, prompt=body["prompt"], max_tokens=16, temperature=0, stream=True)
        if c.choices)
    assert got == text
    r = _complete(router.url, "hello")
    assert len(r.headers["x-request-id"]) >= 16  # generated when the client sends none


def test_client_disconnect_aborts_the_engine_request(stack):
    router, engines = stack
    body = {"prompt": "A long tale of the sea", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        worker = r.headers["x-tandem-worker"]
        next(r.iter_lines())  # the stream is running on the engine
    url = next(w["url"] for w in router.workers() if w["id"] == worker)
    deadline = time.monotonic() + 10
    while httpx.get(url + "/load", timeout=5).json()["server_load"] != 0:  # aborted, not run to 400 tokens
        assert time.monotonic() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.05)
    m = metrics(url)
    assert metric(m, "tandem:request_success_total", finished_reason="abort") >= 1
    assert metric(metrics(router.url), "tandem_router_client_disconnects_total", route="/v1/completions") >= 1


def _prefix_counters(engines) -> tuple[float, float]:
    hits = queries = 0.0
    for e in engines:
        m = metrics(e.url)
        hits += metric(m, "tandem:prefix_cache_hits_total")
        queries += metric(m, "tandem:prefix_cache_queries_total")
    return hits, queries


SYSTEMS = [f"System {i}: " + " ".join(f"rule-{i}-{j} says the {w} must be kept" for j, w in
                                       enumerate(("fox", "dog", "sun", "tea", "cat", "map", "key", "sea")))
           for i in range(4)]


def test_shared_prefix_lands_each_prefix_on_one_engine(stack):
    router, engines = stack
    assert httpx.post(router.url + "/flush_cache", timeout=10).status_code == 200
    tok = httpx.post(engines[0].url + "/tokenize", json={"prompt": SYSTEMS[0]}, timeout=10).json()
    prefix_tokens = tok["count"]
    assert prefix_tokens >= 64  # several full KV pages (page size 16)
    hits0, queries0 = _prefix_counters(engines)
    landed: dict[int, set[str]] = {i: set() for i in range(len(SYSTEMS))}
    jobs = [(i, f"{SYSTEMS[i]}\nQuestion {q}: what is kept?") for q in range(4) for i in range(len(SYSTEMS))]

    def run(job):
        i, prompt = job
        r = _complete(router.url, prompt, 4)
        assert r.status_code == 200, r.text
        return i, r.headers["x-tandem-worker"]

    with ThreadPoolExecutor(2) as pool:
        for i, worker in pool.map(run, jobs[:len(SYSTEMS)]):  # first sight of each prefix
            landed[i].add(worker)
        for i, worker in pool.map(run, jobs[len(SYSTEMS):]):
            landed[i].add(worker)
    assert all(len(ws) == 1 for ws in landed.values()), landed
    assert len({w for ws in landed.values() for w in ws}) >= 2  # new prefixes spread out
    # Each prefix is prefilled once; its 3 repeats hit the engine's cache for its full pages.
    repeats = 3 * len(SYSTEMS)
    want = repeats * (prefix_tokens // 16 - 1) * 16
    # The counters are each engine's last stats report, which may come a step after the last
    # answer: read until they are in (bounded), not once.
    deadline = time.monotonic() + 10
    while (counters := _prefix_counters(engines))[0] - hits0 < want and time.monotonic() < deadline:
        time.sleep(0.1)
    hits1, queries1 = counters
    assert hits1 - hits0 >= want, (hits1 - hits0, queries1 - queries0)
    m = metrics(router.url)
    assert metric(m, "tandem_router_cache_aware_decisions_total", decision="cache_hit") >= repeats


def test_workers_remove_and_add_under_load(stack):
    router, engines = stack
    victim = router.workers()[2]
    stop = threading.Event()
    results: list[tuple[int, str, float, float]] = []  # (status, worker, sent, answered)

    def load(k: int) -> None:
        n = 0
        while not stop.is_set() and n < 200:
            # Distinct openings: no shared prefix, so cache_aware spreads them (smallest tree).
            sent = time.monotonic()
            r = _complete(router.url, f"{uuid.uuid4().hex} load {k}.{n}", 4)
            results.append((r.status_code, r.headers.get("x-tandem-worker", ""), sent, time.monotonic()))
            n += 1

    threads = [threading.Thread(target=load, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        gone = httpx.delete(f"{router.url}/workers/{victim['id']}", timeout=10)
        assert gone.status_code == 200 and gone.json()["url"] == victim["url"]
        removed_at = time.monotonic()
        assert victim["url"] not in [w["url"] for w in router.workers()]
        time.sleep(1.0)
        back = httpx.post(router.url + "/workers", json={"url": victim["url"]}, timeout=10)
        assert back.status_code == 201 and back.json()["is_healthy"], back.text
        new_id = back.json()["id"]
        readded_at = time.monotonic()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(w == new_id for _, w, _, _ in results):
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert all(status == 200 for status, _, _, _ in results), [r for r in results if r[0] != 200][:3]
    # Nothing sent after the removal went to the removed worker, however long the requests
    # already there took to finish (the send time decides, not the answer time).
    between = [w for _, w, sent, answered in results if removed_at < sent and answered < readded_at]
    assert between and victim["id"] not in between
    assert any(w == new_id for _, w, _, _ in results)  # the re-added worker takes traffic again


def test_sigkill_engine_under_load(stack):
    _, engines = stack
    # Round robin spreads the streams over all three engines, so some survive the kill.
    router = RouterProcess([e.url for e in engines], *ROUTER_FLAGS, "--policy", "round_robin")
    try:
        _sigkill_under_load(router, engines)
    finally:
        router.stop()


def _sigkill_under_load(router: RouterProcess, engines: list[Server]) -> None:
    by_id = {w["id"]: w["url"] for w in router.workers()}
    n_streams = 6
    started = threading.Barrier(n_streams + 1, timeout=60)
    outcomes: list = [None] * n_streams

    def stream(k: int) -> None:
        body = {"prompt": f"stream {k}: " + "the sea and the key " * (k + 1), "max_tokens": 400,
                "ignore_eos": True, "temperature": 0}
        try:
            headers, events = _sse(router.url, body, on_first=lambda h: started.wait())
            outcomes[k] = (headers["x-tandem-worker"], events)
        except Exception as exc:  # noqa: BLE001 - recorded and asserted on below
            outcomes[k] = ("?", exc)

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(n_streams)]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first bytes: they are "started"
    active = {w["id"]: w["requests_active"] for w in router.workers()}
    victim_id = max(active, key=active.get)
    victim = next(e for e in engines if e.url == by_id[victim_id])
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    t_kill = time.monotonic()
    # Requests sent after the kill succeed elsewhere (retried before their first byte).
    after = [_complete(router.url, f"after the kill {i}", 4) for i in range(6)]
    assert all(r.status_code == 200 and r.headers["x-tandem-worker"] != victim_id for r in after), \
        [r.text for r in after]
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a stream hung"
    broken = [o for o in outcomes if o[0] == victim_id]
    fine = [o for o in outcomes if o[0] != victim_id]
    assert broken, outcomes
    for _, events in broken:  # started on the dead engine: an explicit error, then [DONE]
        assert isinstance(events, list), events
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    for _, events in fine:
        assert isinstance(events, list) and events[-1] == "[DONE]", events
        assert "error" not in events[-2] and sum(len(e["choices"]) for e in events[:-1]) >= 1, events[-3:]
    assert fine, outcomes  # round robin put streams on the other engines too
    # Ejected (a refused connection or two failed health checks, 0.3 s apart) ...
    deadline = time.monotonic() + 10
    while next(w for w in router.workers() if w["id"] == victim_id)["is_healthy"]:
        assert time.monotonic() < deadline, "dead engine still in rotation"
        time.sleep(0.05)
    assert time.monotonic() - t_kill < 30
    m = metrics(router.url)
    assert metric(m, "tandem_router_worker_healthy", worker=by_id[victim_id]) == 0
    assert metric(m, "tandem_router_stream_errors_total", route="/v1/completions") >= len(broken)
    # ... and re-admitted when it comes back on the same address.
    port = int(by_id[victim_id].rsplit(":", 1)[1])
    engines[engines.index(victim)] = Server(_model_of(victim),
                                            "--max-running-requests", "8", port=port)
    router.wait_healthy(3, timeout=30)
    assert next(w for w in router.workers() if w["id"] == victim_id)["is_healthy"]


def _model_of(server: Server) -> str:
    args = server.proc.args
    return args[args.index("--model-path") + 1]
