"""`tandem serve` as a user meets it: time to ready, first-token latency, and each process's memory.

Starts ``tandem serve`` with the given flags (default: the bundled pair), then reports

- ``ready_s``: from the spawn to the first ``/health`` 200 (``--cold``: with an empty compile
  cache, so a CPU start includes building its decode programs, as a machine's first start does);
- ``ttft_first_ms``: a 1-token completion sent right after ready; ``ttft_ms``: the median of
  the next five;
- per process (``tandem-worker``, ``tandem-scheduler``, ``tandem-tokenizer``, the supervisor):
  RSS and PSS (proportional set size: shared pages split between their users, so the sum is
  the tree's real footprint) once idle, and the peak of each under ``--streams`` concurrent
  streaming requests;
- ``stop_s``: from SIGTERM to the exit of ``tandem serve`` (every process), nothing in flight.

    python benchmarks/serve_footprint.py [--cold] [--streams 8] [--json OUT] -- [tandem serve flags]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.procfs import cmdline, cpu_threads, memory_mb, tree  # noqa: E402
from benchmarks.router import free_port  # noqa: E402


def _label(pid: int, root: int, comm: str) -> str:
    """The children name themselves ``tandem-<role>`` (truncated to 15 characters by Linux)."""
    if pid == root:
        return "supervisor"
    if "resource_tracker" in cmdline(pid):
        return "mp-resource-tracker"
    return comm


def snapshot(root: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for pid, comm in sorted(tree(root).items()):
        name = _label(pid, root, comm)
        rss, pss = memory_mb(pid)
        key = name if name not in out else f"{name}.{pid}"
        out[key] = {"rss_mb": round(rss, 1), "pss_mb": round(pss, 1)}
    return out


def totals(snap: dict[str, dict[str, float]]) -> dict[str, float]:
    return {"rss_mb": round(sum(v["rss_mb"] for v in snap.values()), 1),
            "pss_mb": round(sum(v["pss_mb"] for v in snap.values()), 1)}


def completion(client: httpx.Client, max_tokens: int, stream: bool = False) -> float:
    """Seconds to the first token (the whole answer for a non-streamed one)."""
    body = {"model": client.get("/v1/models").json()["data"][0]["id"], "prompt": "ROMEO:\n", "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}
    t0 = time.perf_counter()
    if not stream:
        client.post("/v1/completions", json=body).raise_for_status()
        return time.perf_counter() - t0
    first = None
    with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - t0
    return first or 0.0


def under_streams(url: str, root: int, streams: int, tokens: int) -> dict[str, dict[str, float]]:
    """The peak RSS / PSS of each process while ``streams`` streaming requests run, its CPU
    seconds over them and its threads."""
    peak: dict[str, dict[str, float]] = {}
    pids = {_label(pid, root, comm): pid for pid, comm in tree(root).items()}
    cpu0 = {name: cpu_threads(pid)[0] for name, pid in pids.items()}
    done = threading.Event()

    def one() -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            completion(c, tokens, stream=True)

    workers = [threading.Thread(target=one) for _ in range(streams)]
    for w in workers:
        w.start()

    def sample() -> None:
        while not done.is_set():
            for name, mem in snapshot(root).items():
                cur = peak.setdefault(name, {"rss_mb": 0.0, "pss_mb": 0.0})
                for k in cur:
                    cur[k] = max(cur[k], mem[k])
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    for w in workers:
        w.join()
    done.set()
    sampler.join()
    for name, pid in pids.items():
        if name in peak:
            cpu, threads = cpu_threads(pid)
            peak[name].update(cpu_s=round(cpu - cpu0[name], 2), threads=threads)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--cold", action="store_true", help="start with an empty TORCHINDUCTOR_CACHE_DIR (removed after)")
    a, serve_flags = ap.parse_known_args()
    serve_flags = [f for f in serve_flags if f != "--"]
    port = free_port()
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tandem-footprint-{port}.log"), "w")
    cache = tempfile.mkdtemp(prefix="tandem-cold-") if a.cold else None
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache} if cache else None
    t0 = time.perf_counter()
    proc = subprocess.Popen([a.python, "-m", "tandem", "serve", "--port", str(port), "--log-level", "info",
                             *serve_flags], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    result: dict = {"flags": serve_flags, "log": log.name, "cold": a.cold}
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"tandem serve exited with {proc.returncode} (see {log.name})")
                try:
                    if client.get("/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            result["ready_s"] = round(time.perf_counter() - t0, 2)
            result["ttft_first_ms"] = round(1e3 * completion(client, 1), 1)
            result["ttft_ms"] = round(1e3 * statistics.median(completion(client, 1) for _ in range(5)), 1)
            time.sleep(1.0)
            idle = snapshot(proc.pid)
            result["idle"] = {"processes": idle, "total": totals(idle)}
        busy = under_streams(url, proc.pid, a.streams, a.stream_tokens)
        result[f"streams_{a.streams}"] = {"processes": busy, "total": totals(busy)}
        time.sleep(1.0)  # the streams' last outputs are out: an idle server is stopped
        t1 = time.perf_counter()
        proc.terminate()
        proc.wait(30)
        result["stop_s"] = round(time.perf_counter() - t1, 2)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
