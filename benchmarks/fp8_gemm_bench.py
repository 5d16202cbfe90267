"""FP8 linears against bf16 at the benchmark models' shapes (Llama-3.1-8B, the Gemma-4 9B
shape), each timed inside a CUDA graph with its weights rotated over more than L2:

- decode rows (1, 2, 4): the FP8 linear as the engine launches it (``kernels/fp8_linear.py``,
  dynamic activations and weight-only), the tensor-core GEMV's tiles (``fp8_gemv.fp8_gemv_dot``)
  and, at one row, the one-row loop's (``fp8_gemv_row``), against the bf16 path (``gemv.linear``: the GEMV or cuBLAS): microseconds and the share of the
  copy bandwidth its weight bytes stream at;
- batches and prefill (16 to 8192 rows): bf16 cuBLAS, the FP8 GEMM with dynamic activations
  (its quantization kernel included) and weight-only, and ``torch._scaled_mm`` (per-token
  activation and per-row weight scales; its torch quantization included, and alone): TFLOP/s.
  This decides the GEMM: ``decision`` names the fastest FP8 path per row count, and the ratio to
  bf16 (prefill in FP8 must not be slower than bf16);
- the FP8 GEMM's split-K (``--only splits``): every split count 1-6 at 16-256 rows, the fastest
  per shape, and the time the launch rule (``fp8_gemm.gemm_splits``) would take summed over the
  shapes for each SPLIT_FILL / SPLIT_MIN_TILES pair: what sets those constants.

    python benchmarks/fp8_gemm_bench.py [--json OUT] [--only gemv,gemm,splits]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hbm_bandwidth import copy_bandwidth  # noqa: E402
from gpu_worker.kernels import gemv as G  # noqa: E402
from gpu_worker.kernels import fp8_linear as L  # noqa: E402
from gpu_worker.kernels import fp8_gemm as GM  # noqa: E402
from gpu_worker.kernels.fp8_gemm import fp8_gemm  # noqa: E402
from gpu_worker.kernels.fp8_gemv import fp8_gemv_dot, fp8_gemv_row  # noqa: E402
from gpu_worker.kernels.fp8_quant import quantize_acts  # noqa: E402
from gpu_worker.quant.fp8_math import quantize_rows  # noqa: E402

L2_BYTES = 200 << 20


def graph_time(fn, reps: int) -> float:
    """Seconds a call of what ``fn`` runs ``reps`` times (rotated weights), replayed in a CUDA graph."""
    from triton.testing import do_bench_cudagraph

    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=40, return_mode="median") / 1e3 / reps
SHAPES = [("8B qkv", 6144, 4096), ("8B o", 4096, 4096), ("8B gate_up", 28672, 4096), ("8B down", 4096, 14336),
          ("9B qkv", 8192, 3840), ("9B gate_up", 30720, 3840), ("9B down", 3840, 15360)]
GEMV_ROWS = (1, 2, 4)
GEMM_ROWS = (16, 32, 64, 128, 256, 1024, 4096, 8192)
SPLIT_ROWS = (16, 32, 64, 128, 256)
MAX_SPLITS = 6
SPLIT_RULES = [(fill, tiles) for fill in (1, 2, 3, 4) for tiles in (2, 4, 8)]
# one-row kernel tiles: (block_n, groups, num_warps, num_stages)
ROW_TRIES = [dict(block_n=8, groups=4, num_warps=2, num_stages=4), dict(block_n=16, groups=2, num_warps=2, num_stages=4)]
# tensor-core GEMV tiles: (block_n, num_warps, num_stages)
DOT_TRIES = [dict(block_n=bn, num_warps=w, num_stages=st)
             for bn, w, st in ((16, 2, 4), (32, 4, 4), (64, 4, 4), (64, 4, 6), (128, 4, 4), (128, 8, 4), (128, 4, 6))]


def _weights(n: int, k: int, fp8: bool):
    """Copies of one [n, k] weight spanning more than L2 (bf16, or e4m3 with row scales)."""
    nbytes = n * k * (1 if fp8 else 2)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    if fp8:
        w8, s = quantize_rows(w)
        return [(w8.clone(), s.clone()) for _ in range(max(1, -(-L2_BYTES // nbytes)))]
    return [w.clone() for _ in range(max(1, -(-L2_BYTES // nbytes)))]


def gemv_rows(bw: float) -> list[dict]:
    rows = []
    for label, n, k in SHAPES:
        wb, w8 = _weights(n, k, False), _weights(n, k, True)
        for m in GEMV_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = {"shape": label, "m": m, "n": n, "k": k}

            def add(impl: str, fn, **extra) -> None:
                try:
                    sec = graph_time(fn, len(w8))
                    rows.append(base | extra | {"impl": impl, "us": sec * 1e6, "frac_of_copy_bw": n * k / sec / bw})
                except Exception as exc:  # noqa: BLE001 -- a config that does not build is a row too
                    rows.append(base | extra | {"impl": impl, "error": repr(exc)[:200]})

            sec = graph_time(lambda: [G.linear(x, w) for w in wb], len(wb))
            rows.append(base | {"impl": "bf16 (engine)", "us": sec * 1e6, "frac_of_copy_bw": n * k * 2 / sec / bw})
            for acts in ("dynamic", "none"):
                add(f"fp8 {acts} (engine)", lambda: [L.fp8_linear(x, w, s, 1, acts) for w, s in w8])
            for cfg in DOT_TRIES:
                add("fp8 dot", lambda: [fp8_gemv_dot(x, w, s, 1, 1, cfg=cfg) for w, s in w8], config=cfg)
            add("fp8 dot none", lambda: [fp8_gemv_dot(x, w, s, 1, 0) for w, s in w8])
            if m > 1:
                continue
            for cfg in ROW_TRIES:
                add("fp8 row", lambda: [fp8_gemv_row(x, w, s, 1, 1, cfg=cfg) for w, s in w8], config=cfg)
        del wb, w8
        torch.cuda.empty_cache()
    return rows


def _per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (e4m3, float32 [M, 1]): one scale a token, in torch."""
    xs = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
    return (x.float() / xs).clamp(-448, 448).to(torch.float8_e4m3fn), xs


def _scaled_mm(x8: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """torch._scaled_mm: per-token activation scales, per-row weight scales (cuBLASLt FP8)."""
    return torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)


def gemm_rows() -> list[dict]:
    rows = []
    for label, n, k in SHAPES:
        wb, w8 = _weights(n, k, False), _weights(n, k, True)  # small batches stream W: more than L2
        for m in GEMM_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            flops = 2 * m * n * k
            base = {"shape": label, "m": m, "n": n, "k": k}
            impls = {
                "bf16 cublas": lambda: [F.linear(x, w) for w in wb],
                "fp8 triton dynamic": lambda: [L.fp8_linear(x, w, s, 1, "dynamic") for w, s in w8],
                "fp8 triton weight-only": lambda: [fp8_gemm(x, None, w, s, 1, x.dtype) for w, s in w8],
                "fp8 scaled_mm": lambda: [_scaled_mm(*_per_token(x), w, s) for w, s in w8],
            }
            xq, xs = quantize_acts(x)
            x8t, tok = _per_token(x)
            impls["fp8 triton gemm alone"] = lambda: [fp8_gemm(xq, xs, w, s, 1, x.dtype) for w, s in w8]
            impls["fp8 scaled_mm alone"] = lambda: [_scaled_mm(x8t, tok, w, s) for w, s in w8]
            if m <= 64:  # small decode batches stream W: other GEMM tiles
                for bn in (32, 64, 128):
                    for st in (4, 6):
                        cfg = dict(block_m=max(16, min(64, m)), block_n=bn, num_warps=4, num_stages=st)
                        impls[f"fp8 gemm n{bn} s{st}"] = (
                            lambda cfg=cfg: [fp8_gemm(xq, xs, w, s, 1, x.dtype, cfg=cfg) for w, s in w8])
            for name, fn in impls.items():
                try:
                    sec = graph_time(fn, len(wb) if name.startswith("bf16") else len(w8))
                    rows.append(base | {"impl": name, "us": sec * 1e6, "tflops": flops / sec / 1e12})
                except Exception as exc:  # noqa: BLE001
                    rows.append(base | {"impl": name, "error": repr(exc)[:200]})
        del wb, w8
        torch.cuda.empty_cache()
    return rows


def split_rows() -> list[dict]:
    """The engine's GEMM (dynamic activations, its tile for the row count) at every split count."""
    rows = []
    for label, n, k in SHAPES:
        w8 = _weights(n, k, True)
        for m in SPLIT_ROWS:
            xq, xs = quantize_acts(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            cfg = GM.gemm_config(m)
            tiles = -(-m // cfg["block_m"]) * -(-n // cfg["block_n"])
            for sp in range(1, MAX_SPLITS + 1):
                sec = graph_time(lambda sp=sp: [fp8_gemm(xq, xs, w, s, 1, torch.bfloat16, splits=sp) for w, s in w8], len(w8))
                rows.append({"shape": label, "m": m, "n": n, "k": k, "tiles": tiles, "splits": sp, "us": sec * 1e6})
                print(f"split {label:11} m={m:4} tiles={tiles:4} splits={sp} {sec * 1e6:8.1f} us", flush=True)
        del w8
        torch.cuda.empty_cache()
    return rows


def split_rules(rows: list[dict]) -> list[dict]:
    """Per row count and SPLIT_FILL / SPLIT_MIN_TILES pair: the sweep's time of the split each
    shape's launch would take under that rule, summed over the shapes, beside the best per shape."""
    out = []
    dev = torch.device("cuda")
    saved = GM.SPLIT_FILL, GM.SPLIT_MIN_TILES
    try:
        for m in SPLIT_ROWS:
            here = [r for r in rows if r["m"] == m]
            shapes = sorted({r["shape"] for r in here})
            t = {(r["shape"], r["splits"]): r["us"] for r in here}
            meta = {r["shape"]: r for r in here}
            best = sum(min(t[(sh, sp)] for sp in range(1, MAX_SPLITS + 1)) for sh in shapes)
            for fill, min_tiles in SPLIT_RULES:
                GM.SPLIT_FILL, GM.SPLIT_MIN_TILES = fill, min_tiles
                pick = {sh: min(MAX_SPLITS, GM.gemm_splits(meta[sh]["tiles"], meta[sh]["k"], dev)) for sh in shapes}
                out.append({"m": m, "fill": fill, "min_tiles": min_tiles, "us": sum(t[(sh, pick[sh])] for sh in shapes),
                            "unsplit_us": sum(t[(sh, 1)] for sh in shapes), "best_us": best, "picks": pick})
    finally:
        GM.SPLIT_FILL, GM.SPLIT_MIN_TILES = saved
    return out


def decision(rows: list[dict]) -> list[dict]:
    """Per row count, summed over the shapes: each path's time, the fastest FP8 path, and its
    ratio to bf16 (> 1: FP8 is faster)."""
    out = []
    for m in sorted({r["m"] for r in rows}):
        total: dict[str, float] = {}
        for r in rows:
            if r["m"] == m and "us" in r:
                total[r["impl"]] = total.get(r["impl"], 0.0) + r["us"]
        paths = {k: v for k, v in total.items() if k in ("fp8 triton dynamic", "fp8 scaled_mm",
                                                        "fp8 triton weight-only")}
        if not paths or "bf16 cublas" not in total:
            continue
        best = min(paths, key=paths.get)
        out.append({"m": m, "us": {k: round(v, 1) for k, v in total.items()}, "fastest_fp8": best,
                    "speedup_vs_bf16": total["bf16 cublas"] / paths[best],
                    "triton_dynamic_vs_bf16": total["bf16 cublas"] / total.get("fp8 triton dynamic", float("inf"))})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default="gemv,gemm")
    a = ap.parse_args()
    bw = copy_bandwidth()
    out: dict = {"copy_bandwidth": bw, "device": torch.cuda.get_device_name()}
    parts = a.only.split(",")
    for part, fn in (("gemv", lambda: gemv_rows(bw)), ("gemm", gemm_rows), ("splits", split_rows)):
        if part not in parts:
            continue
        try:
            out[part] = fn()
        except Exception:  # noqa: BLE001 -- the other part still runs
            out[part] = [{"error": traceback.format_exc()[-1500:]}]
    if "gemm" in out:
        out["decision"] = decision(out["gemm"])
    if "splits" in out and "error" not in out["splits"][0]:
        out["split_rules"] = split_rules(out["splits"])
    for r in out.get("gemv", []):
        if "us" in r:
            cfg = r.get("config", {})
            tile = " ".join(f"{k[0]}{v}" for k, v in cfg.items())
            print(f"gemv {r['shape']:11} m={r['m']} {r['impl']:20} {tile:18} "
                  f"{r['us']:8.1f} us {r['frac_of_copy_bw']:6.1%} of copy bw")
    for r in out.get("gemm", []):
        if "us" in r:
            print(f"gemm {r['shape']:11} m={r['m']:5} {r['impl']:24} {r['us']:9.1f} us {r['tflops']:7.1f} TFLOP/s")
    for r in out.get("splits", []):
        if "us" in r:
            r["frac_of_copy_bw"] = r["n"] * r["k"] / (r["us"] * 1e-6) / bw
    for d in out.get("split_rules", []):
        print(f"split rule m={d['m']:4} fill={d['fill']} min_tiles={d['min_tiles']}: {d['us']:8.1f} us "
              f"(unsplit {d['unsplit_us']:.1f}, best per shape {d['best_us']:.1f}) {d['picks']}")
    for d in out.get("decision", []):
        print(f"decision m={d['m']:5}: fastest FP8 {d['fastest_fp8']} = {d['speedup_vs_bf16']:.2f}x bf16 "
              f"(triton dynamic {d['triton_dynamic_vs_bf16']:.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
