"""The FP8 part's table (benchmarks/fp8_suite.sh): each engine row in bf16, FP8 weights and FP8
weights + FP8 KV, with its step roofline from the same run's copy bandwidth, the KV pool's
tokens, prefill throughput, and the issue's goals checked.

    python benchmarks/fp8_report.py OUT_DIR DUMMY_MODELS_DIR

Step rooflines: a decode step reads the weights once (FP8 projections a byte an element plus
their scales, the rest bf16) and every row's KV (``roofline.decode_phase_ceiling_tok_s``). An MTP
step (the Gemma-4 9B + assistant rows) reads the target once for the verify, the assistant once
per draft step, and the target's KV: its floor in milliseconds against the measured busy step.
"""

from __future__ import annotations

import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.roofline import decode_phase_ceiling_tok_s, kv_bytes, model_shapes  # noqa: E402

CONFIGS = (("bf16", None, None), ("fp8", "fp8", None), ("fp8kv", "fp8", 1))  # name, --quantization, KV bytes
LABEL = {"bf16": "bf16", "fp8": "FP8 weights", "fp8kv": "FP8 weights + FP8 KV"}
MTP_STEPS = 3


def _load(out: str, name: str):
    path = os.path.join(out, name + ".json")
    return json.load(open(path)) if os.path.exists(path) else None


def _pool(r: dict) -> str:
    tokens = r.get("kv_pool_tokens")
    return f"KV pool {tokens:,} tokens" if tokens else "KV pool ?"


def llama_rows(out: str, dm: str, bw: float, goals: list) -> list[str]:
    shapes = functools.cache(lambda q, kv: model_shapes(os.path.join(dm, "llama-3.1-8b"), quantization=q,
                                                        kv_dtype_bytes=kv))
    rows, got = [], {}
    for name, q, kv in CONFIGS:
        r = _load(out, f"fp8_llama_{name}")
        if r is None:
            rows.append(f"8B {LABEL[name]}: missing")
            continue
        rows.append(f"8B {LABEL[name]}: {_pool(r)}; weights read a step {shapes(q, kv)['weight_bytes_read'] / 1e9:.2f} GB")
        for w in r["workloads"]:
            n = w["num_prompts"]
            ceil = decode_phase_ceiling_tok_s(shapes(q, kv), w, bw, rows=max(1, round(w.get("decode_tokens_per_step", 1))))
            frac = w["decode_tok_s"] / ceil if ceil and w.get("decode_tok_s") else float("nan")
            got[(name, n)] = (w["output_tok_s"], frac)
            rows.append(f"   {n:>3} req: {w['output_tok_s']:9.1f} tok/s, decode {w.get('decode_busy_ms_per_step', 0):.3f} ms "
                        f"a step = {frac:6.1%} of its step roofline ({ceil or 0:.1f} tok/s)")
        if "prefill" in r:
            p = r["prefill"]
            got[(name, "prefill")] = p["input_tok_s"]
            rows.append(f"   prefill {p['num_prompts']} x {p['input_len']}: {p['input_tok_s']:,.0f} tok/s")
        got[(name, "pool")] = r.get("kv_pool_tokens") or 0
    _llama_goals(got, goals)
    return rows


def _llama_goals(got: dict, goals: list) -> None:
    def pool(name):
        return got.get((name, "pool"), 0)

    if ("bf16", 1) in got and ("fp8", 1) in got:
        ratio = got[("fp8", 1)][0] / got[("bf16", 1)][0]
        goals.append((f"8B one request: FP8 {ratio:.2f}x bf16 tok/s (goal >= 1.7)", ratio >= 1.7))
        goals.append((f"8B one request: FP8 at {got[('fp8', 1)][1]:.1%} of its step roofline (goal >= 85%)",
                      got[("fp8", 1)][1] >= 0.85))
    if ("fp8", 64) in got:
        goals.append((f"8B 64 requests: FP8 at {got[('fp8', 64)][1]:.1%} of its step roofline (goal >= 75%)",
                      got[("fp8", 64)][1] >= 0.75))
    if pool("fp8") and pool("fp8kv"):
        ratio = pool("fp8kv") / pool("fp8")
        goals.append((f"KV pool: FP8 KV holds {ratio:.2f}x the tokens of bf16 KV (same weights; goal 2x)",
                      ratio >= 1.95))
    if ("bf16", "prefill") in got and ("fp8", "prefill") in got:
        ratio = got[("fp8", "prefill")] / got[("bf16", "prefill")]
        goals.append((f"prefill: FP8 {ratio:.2f}x bf16 tok/s (goal >= 1.0)", ratio >= 1.0))


def gemma_rows(out: str, dm: str, bw: float) -> list[str]:
    rows = []
    for name, q, kv in CONFIGS:
        r = _load(out, f"fp8_gemma_{name}")
        if r is None:
            rows.append(f"Gemma-4 9B + assistant {LABEL[name]}: missing")
            continue
        t = model_shapes(os.path.join(dm, "gemma4-dense-9b"), quantization=q, kv_dtype_bytes=kv)
        a = model_shapes(os.path.join(dm, "gemma4-dense-9b-assistant"), quantization=q, kv_dtype_bytes=kv)
        w = r["workloads"][0]
        ctx = w.get("decode_ctx_tokens_per_step", 0)
        floor_ms = 1e3 * (t["weight_bytes_read"] + MTP_STEPS * a["weight_bytes_read"] + kv_bytes(t, [round(ctx)])) / bw
        busy = w.get("decode_busy_ms_per_step") or w.get("busy_ms_per_step", 0)
        rows.append(f"Gemma-4 9B + assistant (MTP S={MTP_STEPS}, 1 request) {LABEL[name]}: {w['output_tok_s']:8.1f} tok/s, "
                    f"accept {w.get('accept_length', 1):.2f}, step {busy:.3f} ms busy (draft {w.get('draft_ms_per_step', 0):.3f}) "
                    f"vs floor {floor_ms:.3f} ms = {floor_ms / busy if busy else float('nan'):.1%}; {_pool(r)}")
    return rows


def kernel_rows(out: str) -> list[str]:
    k = _load(out, "fp8_gemm_bench")
    if not k:
        return []
    rows = [f"GEMM m={d['m']:5}: fastest FP8 {d['fastest_fp8']} {d['speedup_vs_bf16']:.2f}x bf16 cuBLAS "
            f"(triton dynamic {d['triton_dynamic_vs_bf16']:.2f}x)" for d in k.get("decision", [])]
    for r in k.get("gemv", []):
        if r.get("impl", "").endswith("(engine)") and "us" in r:
            rows.append(f"GEMV {r['shape']:11} m={r['m']} {r['impl']:14} {r['us']:7.1f} us "
                        f"= {r['frac_of_copy_bw']:6.1%} of copy bw")
    return rows


def main(out: str, dm: str) -> None:
    hbm = _load(out, "hbm")
    bw = hbm["hbm_copy_bandwidth_bytes_s"]
    goals: list = []
    rows = [f"copy bandwidth (ceiling): {bw / 1e12:.2f} TB/s"] + kernel_rows(out) + llama_rows(out, dm, bw, goals) + \
        gemma_rows(out, dm, bw)
    rows += [f"{'PASS' if ok else 'MISS'}  {text}" for text, ok in goals]
    text = "\n".join(rows)
    print(text)
    with open(os.path.join(out, "fp8_summary.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
