"""Operations benchmark: overload, drain and restart of a real `tandem serve`, counting how
every request ended (tokens | error | refused | lost; lost must be 0).

1. overload: closed-loop clients at `--load-factor` x capacity (capacity = max running + max
   queued) for `--seconds`; 503 latency, goodput, and the scheduler's own queue (polled from
   /metrics) against --max-queued-requests.
2. drain: 8 streams (4 running, 4 queued), SIGTERM; time to exit and how the streams ended.
3. restart: 8 streams, SIGKILL of the worker under --restart-on-failure; time until every
   stream ended, until /health is 200 again, and the first good request after.

    python benchmarks/ops_bench.py --out benchmarks/results/ops-$(date +%F).json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.router import PY, Proc, free_port, wait_health  # noqa: E402
from benchmarks.stream_ends import StreamEnd, engine_children, stream_completion  # noqa: E402

BODY = {"prompt": "ROMEO:", "temperature": 0, "ignore_eos": True}


def serve(model: str | None, *extra: str) -> Proc:
    """A CPU ``tandem serve`` (``model`` None: the bundled pair), ready to answer."""
    port = free_port()
    flags = ["--model-path", model] if model else []
    srv = Proc([PY, "-m", "tandem", "serve", *flags, "--device", "cpu", "--port", str(port), "--num-threads", "1",
                "--log-level", "warning", *extra], f"http://127.0.0.1:{port}", f"bench-ops-{port}.log")
    wait_health(srv.url)
    return srv


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


async def _poll_queue(url: str, stop: asyncio.Event, out: dict) -> None:
    async with httpx.AsyncClient(timeout=5) as c:
        while not stop.is_set():
            text = (await c.get(url + "/metrics")).text
            for line in text.splitlines():
                if line.startswith("tandem:num_requests_waiting{"):
                    out["max_sched_waiting"] = max(out.get("max_sched_waiting", 0), float(line.split()[-1]))
                elif line.startswith("tandem:num_requests_running{"):
                    out["max_sched_running"] = max(out.get("max_sched_running", 0), float(line.split()[-1]))
            await asyncio.sleep(0.05)


async def overload(url: str, clients: int, seconds: float, max_tokens: int) -> dict:
    ends: list[tuple[StreamEnd, float]] = []
    stop, queue = asyncio.Event(), {}
    deadline = time.monotonic() + seconds

    async def client_loop(c: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            e = await stream_completion(c, url + "/v1/completions", {**BODY, "max_tokens": max_tokens}, StreamEnd())
            ends.append((e, e.ended_at - t0))
            if e.outcome == "refused":
                await asyncio.sleep(0.05)  # a polite client; Retry-After says 1 s, we stress harder

    poller = asyncio.create_task(_poll_queue(url, stop, queue))
    t_start = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=httpx.Limits(max_connections=clients + 4)) as c:
        await asyncio.wait_for(asyncio.gather(*(client_loop(c) for _ in range(clients))), seconds + 120)
    wall = time.monotonic() - t_start
    stop.set()
    await poller
    by = {k: [d for e, d in ends if e.outcome == k] for k in ("tokens", "error", "refused", "lost")}
    tokens = sum(max_tokens for e, _ in ends if e.outcome == "tokens")
    return {"requests": len(ends), **{k: len(v) for k, v in by.items()},
            "refused_latency_p50_ms": (pct(by["refused"], 50) or 0) * 1e3,
            "refused_latency_p99_ms": (pct(by["refused"], 99) or 0) * 1e3,
            "served_latency_p50_s": pct(by["tokens"], 50), "served_latency_p99_s": pct(by["tokens"], 99),
            "goodput_tok_s": tokens / wall, "wall_s": wall,
            "retry_after_on_every_503": all(e.retry_after for e, _ in ends if e.outcome == "refused"), **queue}


async def streams_then(url: str, n: int, max_tokens: int, wait_started: int, action) -> tuple[list[StreamEnd], float]:
    ends = [StreamEnd() for _ in range(n)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as c:
        tasks = [asyncio.create_task(stream_completion(c, url + "/v1/completions", {**BODY, "max_tokens": max_tokens},
                                                       e)) for e in ends]
        while sum(e.first_chunk.is_set() for e in ends) < wait_started:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        action()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return ends, max(e.ended_at for e in ends) - t0


def outcomes(ends: list[StreamEnd]) -> dict:
    return {k: sum(e.outcome == k for e in ends) for k in ("tokens", "error", "refused", "lost")}


def drain(model: str | None) -> dict:
    srv = serve(model, "--max-running-requests", "4")
    t = {}

    def term():
        t["t0"] = time.monotonic()
        srv.p.send_signal(signal.SIGTERM)

    ends, last_end = asyncio.run(streams_then(srv.url, 8, 96, 4, term))
    srv.p.wait(60)
    return {"streams": outcomes(ends), "last_stream_end_s": last_end,
            "exit_after_sigterm_s": time.monotonic() - t["t0"], "exit_code": srv.p.returncode}


def restart(model: str | None) -> dict:
    srv = serve(model, "--restart-on-failure")
    try:
        worker = engine_children(srv.p.pid)["tandem-worker"]
        ends, all_ended = asyncio.run(streams_then(srv.url, 8, 400, 8, lambda: os.kill(worker, signal.SIGKILL)))
        t0 = time.monotonic() - all_ended
        while httpx.get(srv.url + "/health", timeout=2).status_code != 200:
            assert time.monotonic() - t0 < 120, "engine did not come back"
            time.sleep(0.05)
        healthy = time.monotonic() - t0
        r = httpx.post(srv.url + "/v1/completions", json={**BODY, "max_tokens": 8}, timeout=60)
        restarts = [ln for ln in httpx.get(srv.url + "/metrics").text.splitlines()
                    if ln.startswith("tandem:engine_restarts_total")]
        return {"streams": outcomes(ends), "all_streams_ended_s": all_ended, "health_200_after_kill_s": healthy,
                "next_request_status": r.status_code, "engine_restarts_total": restarts}
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None, help="default: the bundled pair (MTP on)")
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--max-queued", type=int, default=4)
    ap.add_argument("--load-factor", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model = a.model_path
    srv = serve(model, "--max-running-requests", str(a.max_running), "--max-queued-requests", str(a.max_queued))
    try:
        clients = a.load_factor * (a.max_running + a.max_queued)
        result = {"overload": {"clients": clients, "max_running": a.max_running, "max_queued": a.max_queued,
                               **asyncio.run(overload(srv.url, clients, a.seconds, a.max_tokens))}}
    finally:
        srv.stop()
    result["drain"] = drain(model)
    result["restart"] = restart(model)
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
