"""`tandem serve --dp-size 2`: two CPU engines behind one router, started and stopped as one."""

from __future__ import annotations

import os
import signal
import time

import httpx
from openai import OpenAI

from tests.helpers.server import Server, free_port


def _children(pid: int) -> list[tuple[int, list[str]]]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out.append((int(entry), f.read().decode().split("\0")))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_dp_size_two_engines_behind_one_router(ckpts):
    base = free_port()  # engines on base, base + 1
    srv = Server(ckpts["llama"], "--dp-size", "2", "--dp-base-port", str(base), "--router-health-check-interval-secs",
                 "0.3", "--router-health-failure-threshold", "1", "--log-level", "info")
    try:
        workers = lambda: httpx.get(srv.url + "/workers", timeout=5).json()["workers"]  # noqa: E731
        # serve is up once one engine is; the other may still be loading its model
        _wait(lambda: sum(w["is_healthy"] for w in workers()) == 2, 120, "both engines in rotation")
        # The router serves as soon as it sees a healthy engine, but the dp parent is still in
        # start-up until its own poll has seen every engine and the router: an engine lost before
        # then fails the start-up (the whole service stops), so the kill below waits for it.
        _wait(lambda: "ready: 2 engines behind the router" in _read(srv.log_path), 60, "the dp parent ready")
        urls = [w["url"] for w in workers()]
        assert urls == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
        assert all(w["last_error"] is None for w in workers())  # no stale start-up error beside healthy
        # One scrape target: the router's /metrics carries each engine's series, labelled.
        text = httpx.get(srv.url + "/metrics", timeout=5).text
        for port in (base, base + 1):
            assert f'engine="127.0.0.1:{port}"' in text and "tandem_router_requests_total" in text
        assert text.count("# TYPE tandem:num_requests_running gauge") == 1
        # Each child's log lines carry its tag; the supervisor holds no torch.
        log = _read(srv.log_path)
        assert "[engine 0] " in log and "[engine 1] " in log and "[router] " in log
        assert "libtorch" not in _read(f"/proc/{srv.proc.pid}/maps")
        via = OpenAI(base_url=srv.base_url, api_key="x")
        model = via.models.list().data[0].id
        direct = OpenAI(base_url=urls[1] + "/v1", api_key="x")
        for prompt in ("The quick brown fox", "Once upon a time"):
            a = via.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
            b = direct.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
            assert a == b
        kids = _children(srv.proc.pid)
        engines = [(pid, cmd) for pid, cmd in kids if "serve" in cmd]
        assert len(engines) == 2 and sum("router" in cmd for _, cmd in kids) == 1
        victim_pid, cmd = engines[0]
        last_port = len(cmd) - 1 - cmd[::-1].index("--port")  # the dp parent appends the engine's own
        victim_url = f"http://127.0.0.1:{cmd[last_port + 1]}"
        os.kill(victim_pid, signal.SIGKILL)
        for i in range(4):  # the service goes on with one engine
            assert via.completions.create(model=model, prompt=f"after {i}", max_tokens=4).choices
        _wait(lambda: not next(w for w in workers() if w["url"] == victim_url)["is_healthy"], 10, "ejected")
        assert srv.proc.poll() is None
    finally:
        t0 = time.monotonic()
        code = srv.stop(timeout=30)
    assert code == 0 and time.monotonic() - t0 < 30
    assert not [pid for pid, _ in _children(srv.proc.pid)]
    for u in urls:
        try:
            httpx.get(u + "/health", timeout=1)
            raise AssertionError(f"{u} still serving after the stop")
        except httpx.HTTPError:
            pass
