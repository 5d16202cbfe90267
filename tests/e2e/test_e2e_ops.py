"""Operations through real processes: overload, drain on SIGTERM, restart after a SIGKILL, API
keys and CURVE on tcp channels. The promise under test: every accepted request ends with its
tokens or an explicit error, and nothing hangs (every wait here is bounded)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import time

import httpx
import msgspec
import pytest
import zmq
from openai import AuthenticationError, OpenAI

from proto.arrays import pack_i32
from proto.curve import load_keys
from proto.messages import EngineDead, GenerateReq, SamplingParams
from tests.e2e.api_util import metric, metrics
from benchmarks.stream_ends import StreamEnd, engine_children, stream_completion
from tests.e2e.ops_util import pid_alive, wait_until
from tandem.cli import main
from tests.helpers.server import Server

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": "hello there", "max_tokens": 96, "ignore_eos": True, "temperature": 0}


def _run_streams(url: str, n: int, body: dict, action, headers: dict | None = None,
                 wait_started: int | None = None) -> tuple[list[StreamEnd], float, object]:
    """Start n streams; once ``wait_started`` have a first chunk, run ``action()`` (in a thread);
    returns the ends, seconds from the action to the last end, and the action's result."""

    async def main():
        ends = [StreamEnd() for _ in range(n)]
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
            tasks = [asyncio.create_task(stream_completion(client, url, body, e, headers)) for e in ends]
            need = n if wait_started is None else wait_started
            deadline = time.monotonic() + 60
            while sum(e.first_chunk.is_set() for e in ends) < need and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            result = await asyncio.to_thread(action)
            await asyncio.wait_for(asyncio.gather(*tasks), 90)
        return ends, max(e.ended_at for e in ends) - t0, result

    return asyncio.run(main())


# ---------------------------------------------------------------------- tcp + CURVE + key + small queue


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("curve") / "keys")
    assert main(["keys", "generate", d]) == 0
    return d


def _free_port_range(n: int = 4) -> int:
    """A base port whose n successive ports are all free right now (the four tcp channels)."""
    for _ in range(200):
        # Below Linux's ephemeral range (32768-60999): no connect() or bind(0) elsewhere can take
        # one of these between this check and the server binding them.
        base = random.randint(20000, 32000)
        try:
            with contextlib.ExitStack() as stack:
                for i in range(n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


@pytest.fixture(scope="module")
def guarded(ckpts, keys_dir):
    base = _free_port_range()
    srv = Server(ckpts["gemma4"], "--transport", "tcp", "--tcp-base-port", str(base), "--curve-keys-dir", keys_dir,
                 "--max-running-requests", "2", "--max-queued-requests", "2", env={"TANDEM_API_KEY": KEY})
    srv.tcp_base = base
    yield srv
    srv.stop()


def test_api_key_required(guarded):
    url = guarded.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
        err = r.json()["error"]
        assert r.status_code == 401 and err["code"] == 401 and err["type"] == "AuthenticationError", r.text
        assert set(err) == {"message", "type", "param", "code"} and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/v1/models").status_code == 401
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=guarded.base_url, api_key="nope", max_retries=0).models.list()
    ok = OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0)
    assert ok.completions.create(model=ok.models.list().data[0].id, prompt="hi", max_tokens=2).usage.completion_tokens
    assert httpx.get(url + "/health").status_code == 200 and "tandem:" in httpx.get(url + "/metrics").text
    assert httpx.get(url + "/server_info", headers=AUTH).json()["api_key"] == "<redacted>"


def test_body_limit_and_chat_checks(guarded):
    """The default 8 MiB body limit gives 413; a user message without content is a 400 naming
    the field (OpenAI's wording), never a 422."""
    r = httpx.post(guarded.url + "/v1/completions", headers={**AUTH, "content-type": "application/json"},
                   content=b'{"prompt": "' + b"a" * (9 << 20) + b'"}', timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    r = httpx.post(guarded.url + "/v1/chat/completions", json={"messages": [{"role": "user"}]}, headers=AUTH)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages[0].content", r.text
    assert err["message"] == "Missing required parameter: 'messages[0].content'."


def test_overload_at_4x_capacity(guarded):
    """Capacity = 2 running + 2 waiting; 16 concurrent streams: each gets its tokens or a 503 with
    Retry-After in the OpenAI shape; none hangs, none is lost."""
    before = metric(metrics(guarded.url), "tandem:request_rejected_total", reason="overload")
    body = {**LONG, "max_tokens": 48}
    ends, elapsed, _ = _run_streams(guarded.url + "/v1/completions", 16, body, lambda: None, AUTH, wait_started=0)
    outcomes = [e.outcome for e in ends]
    assert set(outcomes) <= {"tokens", "refused"}, [(e.status, e.error) for e in ends]
    refused = [e for e in ends if e.outcome == "refused"]
    assert all(e.status == 503 and e.retry_after and e.error["code"] == 503 for e in refused)
    assert 4 <= outcomes.count("tokens") < 16 and all(e.finish_reason == "length" for e in ends if e.outcome == "tokens")
    after = metrics(guarded.url)
    assert metric(after, "tandem:request_rejected_total", reason="overload") - before == len(refused)
    load = lambda: httpx.get(guarded.url + "/load").json()  # noqa: E731
    assert load()["max_queued_requests"] == 2 and load()["status"] == "ready"
    assert wait_until(lambda: load()["num_requests_waiting"] == 0 and load()["num_requests_running"] == 0, 5)


def _rogue_frames() -> list[bytes]:
    params = SamplingParams(max_new_tokens=64)
    return [msgspec.msgpack.encode(GenerateReq(f"rogue-{i}", pack_i32([5, 6, 7]), params, time.time()))
            for i in range(3)]


def test_rogue_zmq_peer_is_refused(guarded, keys_dir):
    """Without the CURVE keys a peer on the tcp requests channel injects nothing (the scheduler
    reads no frame of it) and is logged; the server keeps serving."""
    info = lambda: httpx.get(guarded.url + "/server_info", headers=AUTH).json()["scheduler_stats"]  # noqa: E731
    received = info()["requests_received"]
    requests_port = guarded.tcp_base  # requests is the first channel
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.PUSH)
        pub, sec = zmq.curve_keypair()  # CURVE, with the server key guessed right, but an unknown client key
        wrong = ctx.socket(zmq.PUSH)
        for s in (plain, wrong):
            s.linger = 0
        wrong.curve_secretkey, wrong.curve_publickey = sec, pub
        wrong.curve_serverkey = load_keys(keys_dir).server_public
        # Inject requests into the scheduler, and a forged EngineDead into the front's outputs
        # channel (had it got through, /health would turn 503).
        dead = msgspec.msgpack.encode(EngineDead("forged by a rogue peer"))
        for s in (plain, wrong):
            s.connect(f"tcp://127.0.0.1:{requests_port}")
            s.connect(f"tcp://127.0.0.1:{requests_port + 1}")  # outputs is the second channel
            for frame in _rogue_frames() + [dead] * 3:
                s.send(frame, zmq.NOBLOCK)  # PUSH round-robins over both connections

        def refused() -> bool:  # the rogues tried and were turned away, as logged (not a fixed sleep)
            with open(guarded.log_path) as f:
                log = f.read()
            return "refused a ZMQ peer" in log and "unknown CURVE key " + pub.decode() in log

        assert wait_until(refused, 30), guarded.output()
        time.sleep(0.5)  # a frame that got through would be read by now
        assert httpx.get(guarded.url + "/health").status_code == 200
        assert info()["requests_received"] == received  # not one frame reached the decoder
        for s in (plain, wrong):
            s.close()
    finally:
        ctx.term()
    r = httpx.post(guarded.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200 and wait_until(lambda: info()["requests_received"] == received + 1, 5)


# ---------------------------------------------------------------------- drain


def test_sigterm_drains_8_streams_then_exits_0(ckpts):
    """4 running + 4 queued streams when SIGTERM arrives: /health turns 503 at once, a new request
    is refused with 503, all 8 finish with their tokens, then the server exits 0."""
    srv = Server(ckpts["gemma4"], "--max-running-requests", "4", "--shutdown-timeout", "30")
    try:
        probes: dict = {}

        def sigterm():
            with httpx.Client(timeout=5) as c:  # made before the clock starts: only the server is timed
                t0 = time.monotonic()
                srv.proc.send_signal(signal.SIGTERM)
                assert wait_until(lambda: c.get(srv.url + "/health").status_code == 503, 5, 0.02)
                probes["health_503_s"] = time.monotonic() - t0
                r = c.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
                probes["new"] = (r.status_code, r.headers.get("retry-after"), r.json()["error"]["code"])

        ends, _, _ = _run_streams(srv.url + "/v1/completions", 8, LONG, sigterm, wait_started=4)
        assert [e.outcome for e in ends] == ["tokens"] * 8, [(e.status, e.error, e.chunks) for e in ends]
        assert all(e.finish_reason == "length" for e in ends)
        assert probes["health_503_s"] < 1.0 and probes["new"] == (503, "1", 503)
        srv.proc.wait(timeout=35)
        assert srv.proc.returncode == 0, srv.output()
        assert "leaked" not in srv.output()  # a clean exit prints no teardown report (nanobind's)
    finally:
        srv.stop()


def test_worker_dies_during_drain(ckpts):
    """SIGTERM, then the worker is killed while streams drain: they end with an explicit error
    at once (not at the 30 s shutdown timeout), and the server still exits 0."""
    srv = Server(ckpts["gemma4"])
    try:
        worker = engine_children(srv.proc.pid)["tandem-worker"]

        def term_then_kill() -> float:
            srv.proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: httpx.get(srv.url + "/health", timeout=2).status_code == 503, 5, 0.02)
            killed = time.monotonic()
            os.kill(worker, signal.SIGKILL)
            return killed

        ends, _, killed = _run_streams(srv.url + "/v1/completions", 4, {**LONG, "max_tokens": 480}, term_then_kill)
        assert [e.outcome for e in ends] == ["error"] * 4, [(e.status, e.error, e.finish_reason) for e in ends]
        elapsed = max(e.ended_at for e in ends) - killed  # from the kill, not from the SIGTERM before it
        assert elapsed <= 5.0 and all("worker process died" in e.error["message"] for e in ends)
        srv.proc.wait(timeout=20)
        assert srv.proc.returncode == 0, srv.output()
    finally:
        srv.stop()


# ---------------------------------------------------------------------- restart


def test_worker_sigkill_with_restart_on_failure(ckpts, tmp_path):
    """SIGKILL the worker under 8 streams: each ends with an explicit error within 5 s, the
    supervisor starts a fresh engine (old processes reaped, no orphan), /health comes back, the
    next request succeeds, engine_restarts_total is 1. Then the model vanishes and the scheduler is
    killed: the restarts fail, back off, and the supervisor gives up with exit 1."""
    model = shutil.copytree(ckpts["gemma4"], tmp_path / "model")
    srv = Server(str(model), "--restart-on-failure", "--max-engine-restarts", "2")
    try:
        old = engine_children(srv.proc.pid)
        assert set(old) == {"tandem-worker", "tandem-schedule", "tandem-front"}
        for comm, pid in old.items():  # ps shows the full title, not the interpreter's command line
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert f.read().rstrip(b"\0").decode() == {"tandem-schedule": "tandem-scheduler"}.get(comm, comm)
        kill = lambda: os.kill(old["tandem-worker"], signal.SIGKILL)  # noqa: E731
        ends, elapsed, _ = _run_streams(srv.url + "/v1/completions", 8, {**LONG, "max_tokens": 400}, kill)
        assert [e.outcome for e in ends] == ["error"] * 8, [(e.status, e.error) for e in ends]
        assert elapsed <= 5.0, f"in-flight streams took {elapsed:.1f}s to end"
        assert all(e.error["code"] == 503 and "worker process died" in e.error["message"] for e in ends)
        assert wait_until(lambda: httpx.get(srv.url + "/health", timeout=2).status_code == 200, 90, 0.2), srv.output()
        # ignore_eos: sampled at temperature 1, the tiny random model may end on EOS early
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.json()
        assert metric(metrics(srv.url), "tandem:engine_restarts_total") == 1
        new = engine_children(srv.proc.pid)
        assert set(new) == set(old) and new["tandem-front"] == old["tandem-front"]
        for role in ("tandem-worker", "tandem-schedule"):
            assert new[role] != old[role] and not pid_alive(old[role])

        shutil.rmtree(model)  # the crash loop: no fresh worker can load the model any more
        os.kill(new["tandem-schedule"], signal.SIGKILL)  # the scheduler's death restarts the engine too
        srv.proc.wait(timeout=60)
        assert srv.proc.returncode == 1
        srv.output()  # flushes the log
        assert "scheduler process died (exit code -9); restarting the engine" in open(srv.log_path).read()
        assert "giving up" in srv.output()
        assert not any(pid_alive(p) for p in (*new.values(), *old.values()))
    finally:
        srv.stop()
