"""Sweep the MoE expert kernels' launch shapes at a model's real shape on the GPU and write the
best as a ``gpu_worker/kernels/moe_configs.json`` entry.

    python benchmarks/moe_tune.py --config benchmarks/configs/gemma4-26b-a4b.json --out OUT \
        [--tokens 1,2,4,8,64,256,1024,4096] [--budget-s 480]

For each token count: the decode path's two passes (1-4 tokens) or, past 4 tokens, the
grouped path's alignment block and each pass's tiles, each candidate timed in a CUDA graph of
``--reps`` launches that rotates over ``--copies`` copies of the expert weights (together past
L2, so every launch streams its weights from HBM), with random top-k routing. Reports each
pass's time and its achieved bandwidth (the selected experts' bytes over the time); writes
``OUT/moe_tune_<shape>.json`` (the entry and every timing) and prints the entry. Copy it into
``moe_configs.json`` under its key (``E=..,H=..,I=..,K=..``) to use it. ``--budget-s`` stops
the sweep early, keeping the best so far. ``--fp8``: e4m3 experts with a float32 scale per
output row (``--quantization fp8``'s layout), the entry's ``decode_fp8`` / ``gemm_fp8``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_worker.kernels.activation import ACTS  # noqa: E402
from gpu_worker.kernels.moe_align import align_block  # noqa: E402
from gpu_worker.kernels.moe_configs import shape_key  # noqa: E402
from gpu_worker.kernels.moe_decode import DECODE_MAX_TOKENS, expert_gemv  # noqa: E402
from gpu_worker.kernels.moe_gemm import grouped_gemm  # noqa: E402
from gpu_worker.models.config import parse_config  # noqa: E402

DECODE = [dict(block_n=bn, block_k=bk, num_warps=4, num_stages=s)
          for bn, bk, s in itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 5))]
GEMM = [dict(block_n=bn, block_k=bk, group_m=8, num_warps=w, num_stages=s)
        for bn, bk, w, s in itertools.product((64, 128), (64, 128), (4, 8), (3, 4))]
BLOCK_M = (16, 32, 64)


def moe_shape(config: str) -> tuple[int, int, int, int, str]:
    cfg = json.load(open(config))
    spec = parse_config(cfg)
    moe = next(layer.moe for layer in spec.layers if layer.moe is not None)
    act = getattr(spec, "hidden_act", "silu")
    return moe.num_experts, spec.hidden_size, moe.intermediate_size, moe.top_k, act


def time_graph(fn, reps: int) -> float:
    """Mean seconds of one ``fn(i)`` (i = the launch's weight copy), replayed in a CUDA graph."""
    fn(0)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (3 * reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,2,4,8,32,64,128,256,1024,4096")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--fp8", action="store_true", help="e4m3 experts, a scale per output row")
    a = ap.parse_args()
    e, h, i, k, act = moe_shape(a.config)
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    wdt = torch.float8_e4m3fn if a.fp8 else dt
    gate_up = [(torch.randn(e, 2 * i, h, device=dev) * (16 if a.fp8 else h**-0.5)).to(wdt) for _ in range(a.copies)]
    down = [(torch.randn(e, h, i, device=dev) * (16 if a.fp8 else i**-0.5)).to(wdt) for _ in range(a.copies)]
    s_gu = torch.rand(e, 2 * i, 1, device=dev) * h**-0.5 / 16 if a.fp8 else None
    s_d = torch.rand(e, h, 1, device=dev) * i**-0.5 / 16 if a.fp8 else None
    expert_bytes = (2 * i * h + h * i) * (1 if a.fp8 else 2)
    t_end = time.perf_counter() + a.budget_s
    suffix = "_fp8" if a.fp8 else ""
    log, entry = [], {f"decode{suffix}": {}, f"gemm{suffix}": []}
    tokens = [int(x) for x in a.tokens.split(",")]

    def inputs(t):
        ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)]).int()
        x = torch.randn(t, h, device=dev, dtype=dt)
        w = torch.rand(t * k, device=dev)
        return ids, x, w, torch.empty(t * k, i, device=dev, dtype=dt), torch.empty(t * k, h, device=dev, dtype=dt)

    def best(name, cands, run, t, union):
        top = None
        for cfg in cands:
            if time.perf_counter() > t_end:
                break
            try:
                s = time_graph(lambda c: run(c, cfg), a.reps)
            except Exception as exc:  # noqa: BLE001 -- a shape the compiler rejects (shared memory)
                log.append({"pass": name, "tokens": t, "cfg": cfg, "error": str(exc)[:200]})
                continue
            log.append({"pass": name, "tokens": t, "cfg": cfg, "us": s * 1e6})
            if top is None or s < top[0]:
                top = (s, cfg)
        if top:
            frac = union * expert_bytes * (2 / 3 if name == "gate_up" else 1 / 3) / top[0]
            print(f"  {name:8} T={t:5}: {top[0] * 1e6:8.1f} us, {frac / 1e12:.2f} TB/s of selected experts, {top[1]}",
                  flush=True)
        return top

    for t in tokens:
        ids, x, w, inter, out = inputs(t)
        union = len(torch.unique(ids))
        if t <= DECODE_MAX_TOKENS:
            for name in ("gate_up", "down"):
                if name == "gate_up":
                    def run(c, cfg):
                        expert_gemv(x, gate_up[c % a.copies], inter, ids, cfg, act=ACTS[act], w_scale=s_gu)
                else:
                    def run(c, cfg):
                        expert_gemv(inter, down[c % a.copies], out, ids, cfg, topk_weights=w, w_scale=s_d)
                top = best(name, DECODE, run, t, union)
                if top and t == max(x for x in tokens if x <= DECODE_MAX_TOKENS):
                    entry[f"decode{suffix}"][name] = top[1]  # the largest decode count decides (MTP's verify)
            continue
        bucket_best = None
        for bm in BLOCK_M:
            align = align_block(ids, e, bm)
            run_g = lambda c, cfg: grouped_gemm(x, gate_up[c % a.copies], inter, align, t * k, k, cfg,  # noqa: E731
                                                act=ACTS[act], w_scale=s_gu)
            run_d = lambda c, cfg: grouped_gemm(inter, down[c % a.copies], out, align, t * k, k, cfg,  # noqa: E731
                                                topk_weights=w, w_scale=s_d)
            g, d = best(f"gate_up/{bm}", GEMM, run_g, t, union), best(f"down/{bm}", GEMM, run_d, t, union)
            if g and d and (bucket_best is None or g[0] + d[0] < bucket_best[0]):
                bucket_best = (g[0] + d[0], {"max_tokens": t, "block_m": bm, "gate_up": g[1], "down": d[1]})
        if bucket_best:
            entry[f"gemm{suffix}"].append(bucket_best[1])
    if entry[f"gemm{suffix}"]:
        entry[f"gemm{suffix}"][-1]["max_tokens"] = 1000000000  # the last bucket serves every larger step
    key = shape_key(e, h, i, k)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"moe_tune_{key.replace(',', '_').replace('=', '')}{suffix}.json")
    json.dump({"key": key, "entry": entry, "timings": log}, open(path, "w"), indent=1)
    print(json.dumps({key: entry}, indent=1))


if __name__ == "__main__":
    main()
