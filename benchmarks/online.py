"""Online serving benchmark against any OpenAI-compatible /v1/completions endpoint.

Streams every request (stream_options.include_usage), sweeps concurrency, and reports TTFT,
ITL (one sample per SSE event, as vllm bench serve and sglang.bench_serving record it), TPOT
per request, p50/p99, and output tokens/s. Output token counts come from the usage chunk.

    python benchmarks/online.py --base-url http://127.0.0.1:8000 --concurrency 1,16 \
        --num-prompts 64 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx
import numpy as np


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt, out_len: int, extra: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}, **extra}
    t0 = time.perf_counter()
    stamps, usage = [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage") and not chunk.get("choices"):
                usage = chunk["usage"]
            elif chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    n_out = usage["completion_tokens"] if usage else len(stamps)
    ttft = (stamps[0] if stamps else end) - t0
    return {
        "ttft": ttft,
        "itl": list(np.diff(stamps)),
        "tpot": (end - t0 - ttft) / (n_out - 1) if n_out > 1 else 0.0,
        "e2e": end - t0,
        "output_tokens": n_out,
    }


async def run_level(url: str, model: str, prompts: list, out_len: int, concurrency: int, extra: dict) -> dict:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def guarded(p):
            async with sem:
                return await one_request(client, url, model, p, out_len, extra)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        wall = time.perf_counter() - t0
    return summarize(results, wall, concurrency)


def _pct(xs, q):
    return float(np.percentile(xs, q)) * 1e3 if len(xs) else 0.0


def summarize(results: list[dict], wall: float, concurrency: int) -> dict:
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tpot = [r["tpot"] for r in results if r["output_tokens"] > 1]
    n_out = sum(r["output_tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "output_tokens": n_out,
        "wall_s": round(wall, 3),
        "output_tok_s": round(n_out / wall, 2),
        "ttft_ms_p50": round(_pct(ttft, 50), 2), "ttft_ms_p99": round(_pct(ttft, 99), 2),
        "itl_ms_p50": round(_pct(itl, 50), 2), "itl_ms_p99": round(_pct(itl, 99), 2),
        "tpot_ms_p50": round(_pct(tpot, 50), 2), "tpot_ms_p99": round(_pct(tpot, 99), 2),
    }


async def server_accept_length(url: str) -> float | None:
    async with httpx.AsyncClient(timeout=10) as client:
        info = (await client.get(url + "/server_info")).json()
    return info.get("avg_spec_accept_length")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=None, help="random token ids below this (default: text prompts)")
    ap.add_argument("--text", default=None, help="a text prompt to use for every request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = a.model or httpx.get(a.base_url + "/v1/models").json()["data"][0]["id"]
    rng = random.Random(a.seed)
    if a.text is not None:
        prompts = [a.text] * a.num_prompts
    else:
        vocab = a.vocab or 256
        prompts = [[rng.randrange(3, vocab) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
    rows = []
    for c in (int(x) for x in a.concurrency.split(",")):
        row = asyncio.run(run_level(a.base_url, model, prompts, a.output_len, c, {}))
        rows.append(row)
        print(json.dumps(row))
    acc = asyncio.run(server_accept_length(a.base_url))
    out = {"model": model, "levels": rows, "avg_spec_accept_length": acc}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
