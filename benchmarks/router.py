"""Router benchmarks: (a) the latency the router adds, (b) cache_aware vs round_robin on a
shared-prefix workload over several real engines.

    python benchmarks/router.py overhead --out benchmarks/results/router-cpu/overhead.json
    python benchmarks/router.py prefix --engines 2 --out benchmarks/results/router-cpu/prefix.json

(a) ``overhead``: a fake upstream engine (``router_fake_upstream.py``: bare ASGI on uvicorn, in
its own process, answering at once) isolates the router's own cost. Each round sends the
same requests directly and through ``tandem router`` (separate process), alternating, at
concurrency 1 and 100; added latency = p50(router) - p50(direct), for whole JSON answers and
for the first SSE chunk of a stream. At c=100 the instant upstream makes it a throughput test
(closed loop: latency = 100 / the slowest process's rate); the "stream paced" case keeps 100
streams open on an upstream that answers like an engine (20 ms to the first token, then one
every 20 ms), which is the added latency a user meets. ``--real`` repeats the c=1 stream case against one real
CPU engine (TTFT of a 1-token completion).
(b) ``prefix``: N real engines, 16 long system prompts x Q questions in a seeded random order
at a fixed concurrency, streamed through the router with each policy (caches flushed between
runs), plus one engine alone with the cluster's whole KV budget (the hit-rate reference).
Reported: the engines' prefix-cache hit rate (hits / queries, their Prometheus counters) and
client-side TTFT p50 / p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": ROOT}
FAKE_UPSTREAM = os.path.join(ROOT, "benchmarks", "router_fake_upstream.py")


# ---------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, timeout: float = 180.0, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy in {timeout}s")


class Proc:
    def __init__(self, args: list[str], url: str, log_name: str):
        self.url = url
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), log_name), "w")
        self.p = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


def start_router(workers: list[str], policy: str, *extra: str) -> Proc:
    port = free_port()
    r = Proc([PY, "-m", "tandem", "router", "--worker-urls", *workers, "--port", str(port), "--policy", policy,
              "--log-level", "warning", *extra], f"http://127.0.0.1:{port}", f"bench-router-{port}.log")
    wait_health(r.url, 30)
    return r


def start_engine(model: str, *extra: str) -> Proc:
    port = free_port()
    e = Proc([PY, "-m", "tandem", "serve", "--model-path", model, "--device", "cpu", "--port", str(port),
              "--num-threads", "1", "--log-level", "warning", *extra], f"http://127.0.0.1:{port}",
             f"bench-engine-{port}.log")
    return e


# ---------------------------------------------------------------------- clients
async def timed(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, float]:
    """(seconds to the first body byte, seconds to the end)."""
    t0 = time.perf_counter()
    first = None
    async with session.post(url + "/v1/completions", json=body) as r:
        async for chunk in r.content.iter_any():
            if first is None:
                first = time.perf_counter()
            if b'"error"' in chunk:
                raise RuntimeError(chunk[:300])
        if r.status != 200:
            raise RuntimeError(f"status {r.status}")
    end = time.perf_counter()
    return (first or end) - t0, end - t0


def session(concurrency: int) -> aiohttp.ClientSession:
    # aiohttp, as the router uses: the lighter client leaves more of the 2 cores to what is measured.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 8),
                                 timeout=aiohttp.ClientTimeout(total=600), trust_env=False)


async def load(url: str, body: dict, concurrency: int, n: int, stagger_s: float = 0.0) -> np.ndarray:
    """n requests at the given concurrency; per request (first byte, end, requests/s of the run).
    ``stagger_s``: worker k starts k * stagger_s late, so equal-length streams do not move in
    lockstep waves (arrivals spread as a real client population's do)."""
    out: list[tuple[float, float]] = []
    async with session(concurrency) as client:
        await asyncio.gather(*(timed(client, url, body) for _ in range(min(concurrency, 20))))  # warm up
        todo = iter(range(n))

        async def worker(k: int):
            await asyncio.sleep(k * stagger_s)
            for _ in todo:
                out.append(await timed(client, url, body))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        rate = n / (time.perf_counter() - t0)
    return np.array([(a, b, rate) for a, b in out])


def pct(a, q) -> float:
    return float(np.percentile(a, q)) * 1000.0  # ms


def pin_router(args, router: Proc, others: list[Proc]) -> dict | None:
    """--pin: the router alone on the last CPU, the client and the upstream on the rest (a
    deployed router has cores of its own; on a 2-vCPU VM they would otherwise share two)."""
    cpus = sorted(os.sched_getaffinity(0))
    if not args.pin or len(cpus) < 2:
        return None
    rest = set(cpus[:-1])
    os.sched_setaffinity(router.p.pid, {cpus[-1]})
    for p in others:
        os.sched_setaffinity(p.p.pid, rest)
    os.sched_setaffinity(0, rest)  # this process is the client
    return {"router_cpus": [cpus[-1]], "client_upstream_cpus": sorted(rest)}


def proc_cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def overhead(args) -> dict:
    fport = free_port()
    fake = Proc([PY, FAKE_UPSTREAM, "--port", str(fport)], f"http://127.0.0.1:{fport}", "bench-fake.log")
    wait_health(fake.url, 30)
    router = start_router([fake.url], "cache_aware")
    pinning = pin_router(args, router, [fake])
    rows = []
    prompt = "The quick brown fox " * 20
    paced = {"prompt": prompt, "max_tokens": 16, "stream": True, "x_ttft_ms": 20, "x_itl_ms": 20}
    cases = [(1, args.requests, "json", {"prompt": prompt, "max_tokens": 1}),
             (1, args.requests, "stream", {"prompt": prompt, "max_tokens": 8, "stream": True}),
             (100, args.requests * 5, "json", {"prompt": prompt, "max_tokens": 1}),
             (100, args.requests * 5, "stream", {"prompt": prompt, "max_tokens": 8, "stream": True}),
             # 100 open streams paced like an engine (20 ms to the first token, then 16 tokens
             # 20 ms apart): the router's added latency when it is not the bottleneck.
             (100, args.requests * 2, "stream paced", paced)]
    period_s = (paced["x_ttft_ms"] + (paced["max_tokens"] - 1) * paced["x_itl_ms"]) / 1000
    try:
        for concurrency, n, kind, body in cases:
            if args.only and (concurrency, kind) not in args.only:
                continue
            res = {"direct": [], "router": []}
            router_cpu = 0.0
            for _ in range(args.rounds):  # alternate, so drift on a shared machine hits both alike
                for name, url in (("direct", fake.url), ("router", router.url)):
                    stagger = period_s / concurrency if kind == "stream paced" else 0.0
                    c0 = proc_cpu_s(router.p.pid)
                    res[name].append(asyncio.run(load(url, body, concurrency, n, stagger)))
                    router_cpu += proc_cpu_s(router.p.pid) - c0 if name == "router" else 0.0
            d = np.concatenate(res["direct"])
            r = np.concatenate(res["router"])
            col = 1 if kind == "json" else 0  # streams: first byte; JSON: whole answer
            row = {"upstream": "fake", "concurrency": concurrency, "kind": kind, "requests": len(r),
                   "direct_p50_ms": pct(d[:, col], 50), "router_p50_ms": pct(r[:, col], 50),
                   "direct_p99_ms": pct(d[:, col], 99), "router_p99_ms": pct(r[:, col], 99),
                   "direct_req_s": float(np.median(d[:, 2])), "router_req_s": float(np.median(r[:, 2]))}
            row["added_p50_ms"] = row["router_p50_ms"] - row["direct_p50_ms"]
            row["added_p99_ms"] = row["router_p99_ms"] - row["direct_p99_ms"]
            row["router_cpu_us_per_request"] = router_cpu / len(r) * 1e6  # warm-up requests included: an upper bound
            row["pinning"] = pinning
            if kind == "stream paced":  # the last token too: every relayed chunk's delay adds up here
                row["direct_end_p50_ms"], row["router_end_p50_ms"] = pct(d[:, 1], 50), pct(r[:, 1], 50)
                row["added_end_p50_ms"] = row["router_end_p50_ms"] - row["direct_end_p50_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        router.stop()
        fake.stop()
    if args.real:
        rows.append(real_overhead(args))
    return {"rows": rows}


def real_overhead(args) -> dict:
    eng = start_engine(args.model)
    wait_health(eng.url)
    router = start_router([eng.url], "cache_aware")
    try:
        body = {"prompt": "MACBETH.\nIs this a dagger which I see before me,", "max_tokens": 1, "stream": True,
                "temperature": 0}
        res = {"direct": [], "router": []}
        for _ in range(args.rounds * 4):
            for name, url in (("direct", eng.url), ("router", router.url)):
                res[name].append(asyncio.run(load(url, body, 1, max(10, args.requests // 20))))
        d, r = np.concatenate(res["direct"]), np.concatenate(res["router"])
        row = {"upstream": "real CPU engine", "concurrency": 1, "kind": "stream (TTFT, 1 token)",
               "requests": len(r), "direct_p50_ms": pct(d[:, 0], 50), "router_p50_ms": pct(r[:, 0], 50),
               "direct_p99_ms": pct(d[:, 0], 99), "router_p99_ms": pct(r[:, 0], 99)}
        row["added_p50_ms"] = row["router_p50_ms"] - row["direct_p50_ms"]
        row["added_p99_ms"] = row["router_p99_ms"] - row["direct_p99_ms"]
        print(json.dumps(row), flush=True)
        return row
    finally:
        router.stop()
        eng.stop()


# ---------------------------------------------------------------------- shared prefix
def system_prompts(n: int, lines: int) -> list[str]:
    with open(os.path.join(ROOT, "benchmarks", "prompts_shakespeare_heldout.txt")) as f:
        texts = [t.strip().replace("\\n", "\n") for t in f if t.strip()]
    rng = random.Random(7)
    out = []
    for i in range(n):
        body = "\n".join(rng.sample(texts, lines))
        out.append(f"[Company {i}: you are player {i}, keep to your part.]\n{body}\n")
    return out


def counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in urls:
        for line in httpx.get(u + "/metrics", timeout=10).text.splitlines():
            if line.startswith("tandem:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("tandem:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def prefix_run(url: str, prompts: list[str], concurrency: int, out_len: int) -> np.ndarray:
    ttfts: list[float] = []
    async with session(concurrency) as client:
        todo = iter(prompts)

        async def worker():
            for p in todo:
                body = {"prompt": p, "max_tokens": out_len, "stream": True, "temperature": 0, "ignore_eos": True}
                ttfts.append((await timed(client, url, body))[0])

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return np.array(ttfts)


def prefix(args) -> dict:
    systems = system_prompts(args.systems, args.lines)
    rng = random.Random(0)
    questions = [f"Q{q}: {w}?" for q, w in enumerate(rng.sample(
        ["who speaks next", "what is the hour", "where is the king", "why so pale", "how fares the night",
         "whose blade is this", "when shall we meet", "what news", "who knocks", "what say you",
         "where goes the army", "who is the thane"], args.questions))]
    work = [s + q for s in systems for q in questions]
    rng.shuffle(work)
    engine_flags = ["--max-total-tokens", str(args.kv_tokens), "--max-running-requests", str(args.concurrency)]
    results: dict = {"config": vars(args) | {"func": None}, "runs": []}
    engines = [start_engine(args.model, *engine_flags) for _ in range(args.engines)]
    try:
        for e in engines:
            wait_health(e.url)
        tok = httpx.post(engines[0].url + "/tokenize", json={"prompt": systems[0]}, timeout=10).json()["count"]
        results["system_prompt_tokens"] = tok
        print(f"system prompt: {tok} tokens; {len(work)} requests", flush=True)
        for policy in args.policies:
            for e in engines:
                httpx.post(e.url + "/flush_cache", timeout=10)
            router = start_router([e.url for e in engines], policy)
            try:
                h0, q0 = counters([e.url for e in engines])
                t0 = time.perf_counter()
                ttft = asyncio.run(prefix_run(router.url, work, args.concurrency, args.output_len))
                wall = time.perf_counter() - t0
                h1, q1 = counters([e.url for e in engines])
            finally:
                router.stop()
            run = {"policy": policy, "engines": args.engines, "hit_rate": (h1 - h0) / max(1.0, q1 - q0),
                   "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "wall_s": wall,
                   "requests": len(ttft)}
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
    finally:
        for e in engines:
            e.stop()
    single = start_engine(args.model, "--max-total-tokens", str(args.kv_tokens * args.engines),
                          "--max-running-requests", str(args.concurrency))
    try:
        wait_health(single.url)
        h0, q0 = counters([single.url])
        t0 = time.perf_counter()
        ttft = asyncio.run(prefix_run(single.url, work, args.concurrency, args.output_len))
        wall = time.perf_counter() - t0
        h1, q1 = counters([single.url])
        run = {"policy": "single engine (direct, whole KV budget)", "engines": 1,
               "hit_rate": (h1 - h0) / max(1.0, q1 - q0), "ttft_p50_ms": pct(ttft, 50),
               "ttft_p99_ms": pct(ttft, 99), "wall_s": wall, "requests": len(ttft)}
        results["runs"].append(run)
        print(json.dumps(run), flush=True)
    finally:
        single.stop()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--requests", type=int, default=400, help="per round at c=1 (x5 at c=100, x2 paced)")
    o.add_argument("--rounds", type=int, default=3)
    o.add_argument("--only", nargs="+", type=lambda v: (int(v.split(":")[0]), v.split(":")[1]),
                   help='cases to run, as CONCURRENCY:KIND, e.g. "100:stream paced" (default: all)')
    o.add_argument("--pin", action="store_true", help="router alone on the last CPU, client + upstream on the rest")
    o.add_argument("--real", action="store_true", help="also measure against one real CPU engine")
    o.add_argument("--model", default=os.path.join(ROOT, "models", "tiny-shakespeare", "target"))
    o.add_argument("--out")
    x = sub.add_parser("prefix")
    x.add_argument("--engines", type=int, default=2)
    x.add_argument("--systems", type=int, default=16)
    x.add_argument("--questions", type=int, default=8)
    x.add_argument("--lines", type=int, default=6, help="held-out passages per system prompt")
    x.add_argument("--concurrency", type=int, default=8)
    x.add_argument("--output-len", type=int, default=4)
    x.add_argument("--kv-tokens", type=int, default=4096, help="--max-total-tokens per engine")
    x.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    x.add_argument("--model", default=os.path.join(ROOT, "models", "tiny-shakespeare", "target"))
    x.add_argument("--out")
    args = p.parse_args()
    result = overhead(args) if args.cmd == "overhead" else prefix(args)
    result["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
