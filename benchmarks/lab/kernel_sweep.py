"""Kernel launch-shape sweeps, each timed inside a CUDA graph (as the engine runs them) with
weights / KV rotated over more than L2 holds (the measurements behind docs/decisions/gemv.md and
attention.md; rerun it before changing a launch shape, and on a new card):

- linear layers at decode shapes: cuBLAS (through F.linear, either BLAS library torch offers)
  against our split-N GEMV (``gpu_worker/kernels/gemv.py``, a config sweep) for M <= 4;
- (``gemv``) the GEMV at 1, 2 and 4 rows on Llama-8B and Gemma-4 9B projections, per-tile
  against the tensor-core variant's launch shapes;
- (``wide``) the tensor-core GEMV at 32 and 64 rows against cuBLAS (Llama-8B projections);
- (``narrow``) split K on short-K launches with few column tiles (1024-wide outputs, the 4-row
  verify's o);
- paged decode attention launch shapes (BLOCK_N, warps, stages) and split counts;
- the logits tail: bf16 -> fp32 conversion and argmax over [rows, vocab] (torch's and ours,
  ``gpu_worker/kernels/argmax.py``).

    python benchmarks/lab/kernel_sweep.py [--json OUT] [--only gemm,gemv,attn,logits,wide,narrow]
    SWEEP_ROTATE_MB=0 python benchmarks/lab/kernel_sweep.py --only gemv   # weights left in L2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.attention_bench import setup as attention_setup  # noqa: E402
from benchmarks.hbm_bandwidth import copy_bandwidth  # noqa: E402
from gpu_worker.attention.triton_backend import decode_splits  # noqa: E402
from gpu_worker.kernels.attention_decode import paged_decode  # noqa: E402
from gpu_worker.kernels.argmax import argmax_last  # noqa: E402
from gpu_worker.kernels.gemv import GEMV_MAX_M, gemv  # noqa: E402

# Rotate over more than a Hopper card's 50 MB L2. SWEEP_ROTATE_MB=0: one copy, so a weight that
# fits stays in L2 between calls (what a kernel costs when its bytes are not the limit: latency,
# ramp and tail).
L2_BYTES = int(float(os.environ.get("SWEEP_ROTATE_MB", "200")) * (1 << 20))
# (label, M, N, K): Llama-3.1-8B's projections at 1 and 4 rows (decode, MTP verify at one
# request) and 64, Qwen3-0.6B's at 256.
LLAMA = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
QWEN = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)]
GEMM_SHAPES = [(f"llama {n}", m, nn, k) for m in (1, 4, 64) for n, nn, k in LLAMA] + \
    [(f"qwen {n}", 256, nn, k) for n, nn, k in QWEN]
GEMV_CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=4, num_stages=st)
                for bn, bk, st in itertools.product((8, 16, 32), (256, 512), (3, 4))] + \
    [dict(block_n=bn, block_k=512, num_warps=8, num_stages=3) for bn in (16, 32)]
ATTN_TUNES = [dict(block_n=bn, num_warps=4, num_stages=st) for bn, st in itertools.product((32, 64, 128), (2, 3, 4))] + \
    [dict(block_n=bn, num_warps=8, num_stages=3) for bn in (64, 128)] + \
    [dict(block_n=16, num_warps=4, num_stages=2), dict(block_n=16, num_warps=8, num_stages=3),
     dict(block_n=32, num_warps=8, num_stages=2)]  # narrower tiles for head dim 512 (Gemma's full layers)


def graph_time(fn, reps: int) -> float:
    """Seconds per call of ``fn`` (which runs ``reps`` rotated calls), replayed as a CUDA graph."""
    from triton.testing import do_bench_cudagraph

    torch.cuda.synchronize()  # the bench runs on a side stream that does not wait for this one
    return do_bench_cudagraph(fn, rep=40, return_mode="median") / 1e3 / reps


def rotated_weights(label: str, m: int, n: int, k: int):
    """Copies of an [n, k] weight spanning more than L2, an [m, k] input, F.linear's result on
    the first copy, and the row's shape fields."""
    nbytes = n * k * 2
    copies = max(1, -(-L2_BYTES // nbytes))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return ws, x, F.linear(x, ws[0]), {"shape": label, "m": m, "n": n, "k": k, "weight_mb": nbytes / 1e6}


def gemm_rows(bw: float) -> list[dict]:
    rows = []
    for label, m, n, k in GEMM_SHAPES:
        ws, x, ref, base = rotated_weights(label, m, n, k)
        nbytes, copies = n * k * 2, len(ws)
        for lib in ("cublaslt", "cublas"):
            torch.backends.cuda.preferred_blas_library(lib)
            sec = graph_time(lambda: [F.linear(x, w) for w in ws], copies)
            rows.append(base | {"impl": lib, "us": sec * 1e6, "frac_of_copy_bw": nbytes / sec / bw})
        torch.backends.cuda.preferred_blas_library("cublaslt")
        if m <= GEMV_MAX_M:
            best = None
            for cfg in GEMV_CONFIGS:
                err = (gemv(x, ws[0], **cfg).float() - ref.float()).abs().max().item()
                sec = graph_time(lambda: [gemv(x, w, **cfg) for w in ws], copies)
                if best is None or sec < best[0]:
                    best = (sec, cfg, err)
            sec, cfg, err = best
            rows.append(base | {"impl": "gemv", "config": cfg, "max_abs_err_vs_cublas": err, "us": sec * 1e6,
                                "frac_of_copy_bw": nbytes / sec / bw})
        del ws
        torch.cuda.empty_cache()
    return rows


# The GEMV at 1, 2 and 4 rows (plain decode, MTP verify at one request) on Llama-3.1-8B's and
# the Gemma-4 9B shape's projections (sliding-layer qkv / o), with the split-K the engine uses
# past SKINNY_MAX_K: cuBLAS, the one-row FMA kernel, and the tensor-core variant's launch shapes.
# (The FMA kernel at 2-4 rows, with and without a deferred reduction, lost to cuBLAS by 2-3x on
# every shape.)
GEMMA = [("qkv", 8192, 3840), ("o", 3840, 4096), ("gate_up", 30720, 3840), ("down", 3840, 15360)]
ROW_SHAPES = [(f"{model} {n}", m, nn, k) for m in (1, 2, 4) for model, shapes in (("llama", LLAMA), ("gemma", GEMMA))
              for n, nn, k in shapes]
ROW_CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=4, num_stages=st, dot=True)
               for bn, bk, st in ((16, 256, 3), (16, 256, 4), (16, 512, 3), (32, 128, 4), (32, 256, 3), (32, 256, 4),
                                  (64, 128, 3), (64, 128, 4))]


def shape_rows(bw: float, label: str, m: int, n: int, k: int, variants) -> list[dict]:
    """cuBLAS and the GEMV launches ``variants`` ((config, splits) pairs) on one shape."""
    ws, x, ref, base = rotated_weights(label, m, n, k)
    nbytes, copies = n * k * 2, len(ws)
    sec = graph_time(lambda: [F.linear(x, w) for w in ws], copies)
    rows = [base | {"impl": "cublaslt", "us": sec * 1e6, "frac_of_copy_bw": nbytes / sec / bw}]
    for cfg, splits in variants:
        err = (gemv(x, ws[0], splits=splits, **cfg).float() - ref.float()).abs().max().item()
        sec = graph_time(lambda: [gemv(x, w, splits=splits, **cfg) for w in ws], copies)
        rows.append(base | {"impl": "gemv", "config": cfg, "splits": splits, "max_abs_err_vs_cublas": err,
                            "us": sec * 1e6, "frac_of_copy_bw": nbytes / sec / bw})
    del ws
    torch.cuda.empty_cache()
    return rows


def gemv_rows(bw: float) -> list[dict]:
    from gpu_worker.kernels.gemv import CONFIG, LONG_K_SPLITS, SKINNY_MAX_K

    rows = []
    for label, m, n, k in ROW_SHAPES:
        splits = LONG_K_SPLITS if k > SKINNY_MAX_K else 1
        cfgs = ([CONFIG] if m == 1 else []) + ROW_CONFIGS
        rows += shape_rows(bw, label, m, n, k, [(cfg, splits) for cfg in cfgs])
    return rows


# (``narrow``) Short-K launches with few column tiles, split K 1..8 ways (``short_k_splits``
# picks by tile count): the Gemma-4 assistant's o, down, full-layer o and input projection and
# Qwen3-0.6B's o and down at one row (1024 outputs: 128 FMA tiles on 132 SMs), the 4-row
# verify's o and qkv on the Gemma-4 9B target (120 / 256 tensor-core tiles), Llama-8B's o at
# four rows, and the Gemma target's one-row o (480 tiles) as the wide reference.
NARROW = [("assistant o", 1, 1024, 4096), ("assistant full o", 1, 1024, 8192), ("assistant pre", 1, 1024, 7680),
          ("qwen o", 1, 1024, 2048), ("qwen down", 1, 1024, 3072), ("gemma o", 4, 3840, 4096),
          ("gemma qkv", 4, 8192, 3840), ("llama o", 4, 4096, 4096), ("gemma o", 1, 3840, 4096)]


def narrow_rows(bw: float) -> list[dict]:
    from gpu_worker.kernels.gemv import launch_config, launch_tiles, short_k_splits

    rows = []
    for label, m, n, k in NARROW:
        cfg = launch_config(m, torch.empty(n, k, device="meta"))
        pick = short_k_splits(launch_tiles(n, cfg), k, cfg["block_k"], torch.device("cuda"))
        rows += [r | {"tiles": launch_tiles(n, cfg), "is_default": r.get("splits") == pick}
                 for r in shape_rows(bw, label, m, n, k, [(cfg, s) for s in (1, 2, 3, 4, 6, 8)])]
    return rows


# (``wide``) The tensor-core GEMV at decode batches of 32 and 64 rows against cuBLAS, on
# Llama-3.1-8B's projections: at 64 rows the 8B step's cuBLAS GEMMs run at 65-85 % of the copy
# bandwidth, and the GEMV's weight stream does not depend on M.
WIDE_CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=4, num_stages=st, dot=True)
                for bn, bk, st in ((32, 128, 4), (64, 128, 3), (64, 64, 4))]


def wide_rows(bw: float) -> list[dict]:
    variants = list(itertools.product(WIDE_CONFIGS, (1, 2, 4)))
    return [r for m in (32, 64) for name, n, k in LLAMA for r in shape_rows(bw, f"llama {name}", m, n, k, variants)]


# (model, rows, context, query heads, KV heads, pages shuffled, head dim, queries per row): the
# Qwen3 recipe's and Llama-8B's decode, and the MTP step's short-context reads on the Gemma-4 9B
# shape: the verify (4 queries a row) and the draft (one), on sliding layers (head dim 256) and
# full ones (512) -- latency-bound at ~600 keys.
ATTN_CASES = [("qwen3-0.6b", 256, 812, 16, 8, False, 128, 1), ("qwen3-0.6b", 256, 812, 16, 8, True, 128, 1),
              ("llama-8b", 64, 640, 32, 8, True, 128, 1), ("llama-8b", 1, 560, 32, 8, False, 128, 1),
              ("gemma-9b sliding verify", 1, 640, 16, 8, False, 256, 4),
              ("gemma-9b full verify", 1, 640, 16, 4, False, 512, 4),
              ("gemma-9b sliding draft", 1, 640, 16, 8, False, 256, 1),
              ("gemma-9b full draft", 1, 640, 16, 4, False, 512, 1)]


def attn_rows(bw: float, sms: int) -> list[dict]:
    rows = []
    for model, bs, ctx, hq, hkv, shuffle, d, t in ATTN_CASES:
        pool, pt, layout, q = attention_setup(bs, ctx, hq, hkv, shuffle, d)
        k, v, slots, kv = pool.k[0], pool.v[0], layout.slots, layout.kv_lens
        q = q.repeat_interleave(t, dim=0)  # t queries a row, at the row's last t positions
        q_pos = (kv[:, None] - t + torch.arange(t, device=kv.device)[None, :]).reshape(-1)
        nbytes = bs * ctx * hkv * d * 2 * 2
        default = decode_splits(bs, hkv, sms)
        other = sorted({1, 2, 4, 8, 16} - {default}) if bs == 1 else []
        cases = [(default, None)] + [(default, t_) for t_ in ATTN_TUNES] + [(s, None) for s in other]
        for sp, tune in cases:
            def run():
                paged_decode(q, k, v, pt, slots, kv, q_pos, t=t, page_size=16, scale=d**-0.5, num_splits=sp,
                             tune=tune)
            try:
                sec = graph_time(run, 1)
            except Exception as exc:  # noqa: BLE001 - a config that does not fit: report, go on
                rows.append({"model": model, "bs": bs, "ctx": ctx, "splits": sp, "tune": tune,
                             "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            rows.append({"model": model, "bs": bs, "ctx": ctx, "shuffled": shuffle, "head_dim": d, "t": t,
                         "splits": sp, "tune": tune or "default",
                         "is_default": tune is None and sp == default,
                         "us": sec * 1e6, "frac_of_copy_bw": nbytes / sec / bw})
            print(f"attn-row {model} bs {bs} ctx {ctx} t {t} splits {sp} {tune or 'default'}: "
                  f"{sec * 1e6:.2f} us", flush=True)  # the log keeps each row if the sweep is cut off
        del pool, k, v
        torch.cuda.empty_cache()
    return rows


def logits_rows() -> list[dict]:
    rows = []
    for r, vocab in ((256, 151936), (64, 128256), (1, 128256)):
        x = torch.randn(r, vocab, device="cuda", dtype=torch.bfloat16)
        xf = x.float()
        for name, fn in (("to_float32", lambda: x.float()), ("argmax_float32", lambda: xf.argmax(-1)),
                         ("argmax_bf16", lambda: x.argmax(-1)), ("argmax_kernel_bf16", lambda: argmax_last(x))):
            rows.append({"rows": r, "vocab": vocab, "op": name, "us": graph_time(fn, 1) * 1e6})
        assert torch.equal(x.argmax(-1), xf.argmax(-1)) and torch.equal(argmax_last(x), x.argmax(-1))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default="gemm,attn,logits")
    a = ap.parse_args()
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"copy_bandwidth_bytes_s": bw}
    for part, fn in (("logits", logits_rows), ("gemm", lambda: gemm_rows(bw)), ("gemv", lambda: gemv_rows(bw)),
                     ("attn", lambda: attn_rows(bw, sms)), ("wide", lambda: wide_rows(bw)),
                     ("narrow", lambda: narrow_rows(bw))):
        if part in a.only.split(","):
            try:
                out[part] = fn()
            except Exception:  # noqa: BLE001 - keep the other parts' figures
                traceback.print_exc()
            if a.json:  # after every part: a sweep cut off by its time limit keeps what it measured
                with open(a.json, "w") as f:
                    json.dump(out, f, indent=1)
    summarize(out)


def summarize(out: dict) -> None:
    for r in out.get("logits", []):
        print(f"logits {r['rows']:>3}x{r['vocab']} {r['op']:15} {r['us']:8.1f} us")
    for r in out.get("gemm", []):
        extra = f" {r['config']} err {r['max_abs_err_vs_cublas']:.3g}" if r["impl"] == "gemv" else ""
        print(f"gemm {r['shape']:14} m {r['m']:>3} {r['impl']:8} {r['us']:8.2f} us {r['frac_of_copy_bw']:6.1%}{extra}")
    for r in out.get("gemv", []) + out.get("wide", []) + out.get("narrow", []):
        cfg = r.get("config")
        extra = f" {cfg} splits {r.get('splits', 1)} err {r['max_abs_err_vs_cublas']:.3g}" if cfg else ""
        extra += " (default)" if r.get("is_default") else ""
        print(f"gemv {r['shape']:14} m {r['m']} {r['impl']:8} {r['us']:8.2f} us {r['frac_of_copy_bw']:6.1%}{extra}")
    best: dict = {}
    for r in out.get("attn", []):
        if "error" in r:
            continue
        key = (r["model"], r["bs"], r["ctx"], r.get("shuffled"))
        if r["is_default"]:
            best.setdefault(key, {})["default"] = r
        if "best" not in best.setdefault(key, {}) or r["us"] < best[key]["best"]["us"]:
            best[key]["best"] = r
    for key, b in best.items():
        d, bb = b.get("default"), b["best"]
        print(f"attn {key}: default {d['us'] if d else float('nan'):.1f} us (splits {d['splits'] if d else '?'}) "
              f"best {bb['us']:.1f} us {bb['frac_of_copy_bw']:.1%} splits {bb['splits']} {bb['tune']}")


if __name__ == "__main__":
    main()
