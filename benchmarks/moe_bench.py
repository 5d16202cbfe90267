"""Mixture-of-experts decode on dummy weights: Gemma 4 26B-A4B (with its frozen-KV assistant)
and Qwen3-30B-A3B (``benchmarks/configs``), decode tok/s beside a step roofline that counts only
the bytes a step must read.

    python benchmarks/moe_bench.py --dummy-dir DM --out OUT [--hbm-json OUT/hbm.json]

Per model, each in its own process (one model's weights on the GPU at a time):

1. ``union``: which experts a decode step selects, measured on the device: an eager in-process
   engine (hooks on every MoE layer) serves ``--union-rows`` requests of 512 random tokens and
   records each decode row's top-k ids per layer for ``--union-steps`` steps. ``u_l(B)``, the
   mean number of distinct experts B rows select in layer l, is averaged over random B-row
   subsets (of one step's rows where B fits in it).
2. ``offline.py`` at 1, 64 and 256 requests (512 in / 256 out): decode tok/s, decode ms a step,
   rows and context a step, the GPU's idle share between steps.
3. The step roofline: ``(fixed weights + sum_l u_l(rows) x one expert's bytes + KV read) /
   copy bandwidth`` (``roofline.moe_step_bytes``), at each run's mean rows and context.

Gemma 4 26B-A4B also runs with its assistant (FROZEN-KV-MTP, S=3) at one request: the MTP decode
step (three draft forwards and a verify of 4 tokens, whose experts are the union of 4 tokens')
against the plain one, beside the same ratio of their byte floors.

``--configs bf16,fp8`` runs steps 2-3 and the MTP run once per configuration (``fp8``:
``--quantization fp8``, the experts and projections in e4m3, the roofline counting their bytes
and scales); the union of step 1 is measured once, in bf16 (dummy weights: quantizing them moves
a routing decision rarely, and the union is a statistic over many). Writes ``OUT/moe.json`` and
prints one table with the goals of issue 38.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MODELS = {"gemma4-26b-a4b": "gemma4-26b-a4b-assistant", "qwen3-30b-a3b": None}
MTP = ["--speculative-algorithm", "FROZEN-KV-MTP", "--speculative-num-steps", "3"]
CONFIGS = {"bf16": ([], None), "fp8": (["--quantization", "fp8"], "fp8")}  # name -> (engine flags, quantization)


def measure_union(model_dir: str, rows: int, steps: int, out: str, device: str = "cuda",
                  prompt_len: int = 512) -> None:
    """Record the routing of ``rows`` decode rows for ``steps`` steps: every MoE layer's top-k ids
    of each decode forward of exactly ``rows`` tokens, saved as [layers, steps, rows, K] (.npy)."""
    import torch

    from gpu_worker.models import moe
    from gpu_worker.models.moe import Experts
    from tandem.inproc import InProcEngine

    # Rows prefilled early decode beside later prefill chunks (those steps are not recorded): each
    # request runs ``spare`` steps past ``steps``, so ``steps`` steps of every row alone follow.
    spare = 8
    eng = InProcEngine(model_dir, device=device, load_format="dummy", disable_cuda_graph=True,
                       disable_piecewise_cuda_graph=True, max_running_requests=rows,
                       context_length=prompt_len + steps + spare + 64)
    layers = sum(isinstance(m, Experts) for m in eng.runner.target.modules())
    seen: list[torch.Tensor] = []
    real = moe.route

    def recording(x, *args):  # every router calls moe.route once a forward, in layer order
        ids, weights = real(x, *args)
        if x.shape[0] == rows:
            seen.append(ids.to(torch.int32).cpu())
        return ids, weights

    moe.route = recording
    try:
        _serve_random(eng, rows, prompt_len, steps + spare)
    finally:
        moe.route = real
    n = min(steps, len(seen) // layers)
    if n == 0:
        raise SystemExit(f"no decode step ran all {rows} rows alone")
    ids = torch.stack(seen[: n * layers]).view(n, layers, rows, -1).transpose(0, 1)
    np.save(out, ids.numpy())


def _serve_random(eng, rows: int, prompt_len: int, new_tokens: int) -> None:
    rng = np.random.default_rng(0)
    vocab = eng.ready.vocab_size
    for r in range(rows):
        eng.submit(f"u{r}", rng.integers(3, vocab - 1, prompt_len).tolist(), max_new_tokens=new_tokens,
                   ignore_eos=True)
    eng.run()


def union_curve(ids: np.ndarray, batch: int, samples: int = 32, seed: int = 0) -> list[float]:
    """ids [layers, steps, rows, K] -> per layer the mean distinct experts over ``batch`` rows
    (random subsets of one step's rows when ``batch`` fits in a step, else of all rows)."""
    rng = np.random.default_rng(seed)
    layers, steps, rows, k = ids.shape
    out = []
    for lay in ids:
        sizes = []
        for _ in range(samples):
            if batch <= rows:
                step = lay[rng.integers(steps)]
                pick = step[rng.choice(rows, batch, replace=False)]
            else:
                flat = lay.reshape(-1, k)
                pick = flat[rng.choice(flat.shape[0], min(batch, flat.shape[0]), replace=False)]
            sizes.append(len(np.unique(pick)))
        out.append(float(np.mean(sizes)))
    return out


def _run(cmd: list[str], log: str, timeout: int) -> bool:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            ok = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
    print(f"  {os.path.basename(log)}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s", flush=True)
    return ok


def offline(model_dir: str, prompts: str, out_json: str, log: str, extra: list[str], timeout: int,
            warmup: int) -> dict | None:
    """offline.py on dummy weights, 512 in / 256 out; ``warmup`` untimed rounds of each workload."""
    running = max(int(n) for n in prompts.split(","))
    cmd = [sys.executable, os.path.join(HERE, "offline.py"), "--model-path", model_dir, "--device", "cuda",
           "--load-format", "dummy", "--log-level", "warning", "--num-prompts", prompts, "--input-len", "512",
           "--output-len", "256", "--max-running-requests", str(max(8, running)), "--warmup-rounds", str(warmup),
           "--json", out_json, *extra]
    return json.load(open(out_json)) if _run(cmd, log, timeout) else None


def report_rows(name: str, shapes: dict, ids: np.ndarray | None, runs: dict | None, bw: float,
                config: str = "bf16") -> list[dict]:
    from benchmarks.roofline import moe_step_bytes

    rows = []
    for w in (runs or {}).get("workloads", []):
        if not w.get("decode_steps"):
            continue
        b = max(1, round(w["decode_tokens_per_step"]))
        unions = union_curve(ids, b) if ids is not None else [float(shapes["num_experts"])] * len(shapes["expert_bytes"])
        need = moe_step_bytes(shapes, unions, w["decode_ctx_tokens_per_step"], b)
        floor_ms = 1e3 * need["total"] / bw
        ceiling = w["decode_tokens_per_step"] * 1e3 / floor_ms
        rows.append({"model": name, "config": config, "requests": w["num_prompts"],
                     "decode_rows": w["decode_tokens_per_step"],
                     "decode_tok_s": w["decode_tok_s"], "decode_ms_step": w["decode_busy_ms_per_step"],
                     "roofline_ms_step": floor_ms, "roofline_tok_s": ceiling,
                     "of_roofline": w["decode_tok_s"] / ceiling, "gpu_idle": w.get("gpu_idle_frac"),
                     "experts_per_layer": float(np.mean(unions)), "bytes": need, "output_tok_s": w["output_tok_s"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dummy-dir", required=True, help="benchmarks/dummy_models.py's output")
    ap.add_argument("--out", required=True)
    ap.add_argument("--hbm-json", default=None, help="hbm_bandwidth.py's output (default: measure here)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--prompts", default="1,64,256")
    ap.add_argument("--union-rows", type=int, default=64)
    ap.add_argument("--union-steps", type=int, default=8)
    ap.add_argument("--union", nargs=2, metavar=("MODEL_DIR", "OUT_NPY"), help=argparse.SUPPRESS)
    ap.add_argument("--no-mtp", action="store_true", help="skip the 26B-A4B MTP run")
    ap.add_argument("--step-timeout", type=int, default=240, help="seconds for each process (union, engine runs)")
    ap.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds of each engine workload first")
    ap.add_argument("--configs", default="bf16", help=f"comma list of {', '.join(CONFIGS)}")
    a = ap.parse_args()
    if a.union:
        measure_union(a.union[0], a.union_rows, a.union_steps, a.union[1])
        return
    os.makedirs(a.out, exist_ok=True)
    if a.hbm_json:
        bw = json.load(open(a.hbm_json))["hbm_copy_bandwidth_bytes_s"]
    else:
        from benchmarks.hbm_bandwidth import copy_bandwidth

        bw = copy_bandwidth()
    from benchmarks.roofline import moe_shapes

    result = {"bandwidth_bytes_s": bw, "rows": [], "mtp": []}
    for name in a.models.split(","):
        d = os.path.join(a.dummy_dir, name)
        npy = os.path.join(a.out, f"moe_union_{name}.npy")
        ok = _run([sys.executable, __file__, "--dummy-dir", a.dummy_dir, "--out", a.out, "--union-rows",
                   str(a.union_rows), "--union-steps", str(a.union_steps), "--union", d, npy],
                  os.path.join(a.out, f"moe_union_{name}.log"), a.step_timeout)
        ids = np.load(npy) if ok else None
        for config in a.configs.split(","):
            flags, quantization = CONFIGS[config]
            shapes = moe_shapes(d, quantization=quantization)
            tag = name if config == "bf16" else f"{name}_{config}"
            runs = offline(d, a.prompts, os.path.join(a.out, f"moe_{tag}.json"),
                           os.path.join(a.out, f"moe_{tag}.log"), flags, a.step_timeout, a.warmup_rounds)
            rows = report_rows(name, shapes, ids, runs, bw, config)
            result["rows"] += rows
            draft = MODELS.get(name)
            if draft and not a.no_mtp:
                mtp = offline(d, "1", os.path.join(a.out, f"moe_{tag}_mtp.json"),
                              os.path.join(a.out, f"moe_{tag}_mtp.log"),
                              flags + MTP + ["--speculative-draft-model-path", os.path.join(a.dummy_dir, draft)],
                              a.step_timeout, a.warmup_rounds)
                plain = next((r for r in rows if r["requests"] == 1), None)
                if mtp and plain and mtp["workloads"][0].get("decode_steps"):
                    result["mtp"].append(mtp_row(name, config, shapes, ids, mtp["workloads"][0], plain))
    with open(os.path.join(a.out, "moe.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(table(result))


def mtp_row(name: str, config: str, shapes: dict, ids: np.ndarray | None, w: dict, plain: dict) -> dict:
    """The MTP step against the plain one (``plain``: its 1-request row), beside their byte floors."""
    from benchmarks.roofline import moe_step_bytes

    u4 = union_curve(ids, 4) if ids is not None else None
    verify = moe_step_bytes(shapes, u4, w["decode_ctx_tokens_per_step"], 1)["total"] if u4 else None
    return {"model": name, "config": config, "mtp_ms_step": w["decode_busy_ms_per_step"],
            "plain_ms_step": plain["decode_ms_step"],
            "ratio": w["decode_busy_ms_per_step"] / plain["decode_ms_step"],
            "accept_length": w.get("accept_length"), "gpu_idle": w.get("gpu_idle_frac"),
            "verify_experts_per_layer": float(np.mean(u4)) if u4 else None,
            "verify_over_plain_bytes": verify / plain["bytes"]["total"] if verify else None}


def table(result: dict) -> str:
    bw = result["bandwidth_bytes_s"]
    lines = [f"MoE decode, dummy weights, 512 in / 256 out; copy bandwidth {bw / 1e12:.2f} TB/s",
             f"{'model':16} {'cfg':>4} {'req':>4} {'rows':>6} {'tok/s':>8} {'ms/step':>8} {'roof ms':>8} {'of roof':>8} "
             f"{'goal':>5} {'idle':>6} {'experts/layer':>13}"]
    for r in result["rows"]:
        goal = 0.75 if r["requests"] == 1 else 0.65 if r["requests"] == 64 else None
        mark = "" if goal is None else ("ok" if r["of_roofline"] >= goal else "MISS")
        idle = f"{r['gpu_idle']:.1%}" if r["gpu_idle"] is not None else "-"
        lines.append(f"{r['model']:16} {r['config']:>4} {r['requests']:>4} {r['decode_rows']:>6.1f} "
                     f"{r['decode_tok_s']:>8.1f} {r['decode_ms_step']:>8.3f} {r['roofline_ms_step']:>8.3f} "
                     f"{r['of_roofline']:>8.1%} {mark:>5} "
                     f"{idle:>6} {r['experts_per_layer']:>13.1f}")
    for m in result["mtp"]:
        floor = f", byte floors {m['verify_over_plain_bytes']:.2f}x" if m["verify_over_plain_bytes"] else ""
        lines.append(f"{m['model']} {m['config']} MTP S=3, 1 request: {m['mtp_ms_step']:.3f} vs plain "
                     f"{m['plain_ms_step']:.3f} ms/step = {m['ratio']:.2f}x "
                     f"(goal <= 1.3x: {'ok' if m['ratio'] <= 1.3 else 'MISS'}); verify "
                     f"reads {m['verify_experts_per_layer']:.1f} experts/layer{floor}; accept length "
                     f"{m['accept_length']}; idle {m['gpu_idle']:.1%}")
    lines.append("goals (issue 38): 1 request >= 75 % of the roofline, 64 requests >= 65 %, idle < 2 %")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
