"""The table gpu_suite.sh prints last: each figure with its ceiling measured in the same run.

    python benchmarks/gpu_report.py OUT_DIR DUMMY_MODELS_DIR
"""

from __future__ import annotations

import functools
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.roofline import decode_ceiling_tok_s, decode_phase_ceiling_tok_s, model_shapes  # noqa: E402


def load(out: str, name: str):
    path = os.path.join(out, name + ".json")
    return json.load(open(path)) if os.path.exists(path) else None


def decode_phase(shapes: dict, w: dict, bw: float, rows: int | None = None) -> str:
    ceil = decode_phase_ceiling_tok_s(shapes, w, bw, rows)
    if ceil is None:
        return "    decode phase: not measured"
    return (f"    decode phase ({w['decode_steps']} steps, {w['decode_tokens_per_step']:.0f} rows, "
            f"{w['decode_busy_ms_per_step']:.2f} ms busy): {w['decode_tok_s']:9.1f} tok/s = "
            f"{w['decode_tok_s'] / ceil:6.1%} of its step roofline {ceil:8.1f}")


# The default-flag runs; with BASE (gpu_suite.sh) each also as NAME_base, the base commit's engine.
LLAMA_RUNS = [("llama_overlap", "overlap on", True), ("llama_no_overlap", "overlap off", True)]
QWEN_RUNS = ["qwen_nano"]
SHORT = {"llama-3.1-8b": "8B", "gemma4-dense-9b": "Gemma-4 9B", "qwen3-0.6b": "Qwen3-0.6B"}


def with_base(out: str, names: list) -> list:
    """Each run, preceded by its base-commit twin where one ran (gpu_suite.sh BASE=)."""
    res = []
    for n in names:
        name = n[0] if isinstance(n, tuple) else n
        if os.path.exists(os.path.join(out, name + "_base.json")):
            res.append((name + "_base", n[1] + " base", *n[2:]) if isinstance(n, tuple) else name + "_base")
        res.append(n)
    return res


def scale_runs(out: str) -> list[tuple[str, str, bool, str]]:
    """Part scale's runs (``scale_<model>.json``): every shape at 1 / 64 / 256 requests."""
    names = sorted(os.path.basename(p)[: -len(".json")] for p in glob.glob(os.path.join(out, "scale_*.json")))
    return [(n, "defaults", False, n[len("scale_"):]) for n in names]


def main(out: str, dm: str) -> None:
    bw = json.load(open(os.path.join(out, "hbm.json")))["hbm_copy_bandwidth_bytes_s"]
    rows = [f"copy bandwidth (ceiling): {bw / 1e12:.2f} TB/s"]
    shapes = functools.cache(lambda name: model_shapes(os.path.join(dm, name)))  # a dummy model's, once
    runs = [(*run, "llama-3.1-8b") for run in with_base(out, LLAMA_RUNS)] + scale_runs(out)
    for name, label, expected, model in runs:
        r = load(out, name)
        if r is None:
            if expected:
                rows.append(f"{name}: missing")
            continue
        for w in r["workloads"]:
            n = w["num_prompts"]
            ceil = decode_ceiling_tok_s(shapes(model), n, 512, 256, bw)
            ceil_all = decode_ceiling_tok_s(shapes(model), n, 512, 256, bw, strict=False)
            short = SHORT.get(model, model)
            rows.append(f"{short:>10} {n:>3} req {label:11}: {w['output_tok_s']:9.1f} tok/s = {w['output_tok_s'] / ceil:6.1%} "
                        f"of {ceil:8.1f} (all-weights ceiling {ceil_all:8.1f}: {w['output_tok_s'] / ceil_all:6.1%}); "
                        f"step {w.get('busy_ms_per_step', 0):.2f} ms busy, idle {w.get('gpu_idle_frac', 0):.2%}")
            # fixed lengths: the decoding rows are alike, so the window bound is exact per row
            rows.append(decode_phase(shapes(model), w, bw, rows=max(1, round(w.get("decode_tokens_per_step", 1)))))
    for qs in with_base(out, ["qwen_small"]):  # the 8B's fixed workloads on the Qwen3-0.6B shape
        q = load(out, qs)
        for w in q["workloads"] if q else []:
            rows.append(f"Qwen3-0.6B {w['num_prompts']:>3} req, 512 in / 256 out ({qs}): "
                        f"{w['output_tok_s']:9.1f} tok/s; idle {w.get('gpu_idle_frac', 0):.2%}")
            rows.append(decode_phase(shapes("qwen3-0.6b"), w, bw))
    for name in with_base(out, QWEN_RUNS):
        q = load(out, name)
        if not q:
            continue
        hf = q.get("hf_transformers", {}).get("output_tok_s", 0)
        e = q["engine"]
        rows.append(f"Qwen3-0.6B nano-vllm recipe ({name}): {e['output_tok_s']:9.1f} tok/s; "
                    f"HF generate {hf:.1f} tok/s; idle {e.get('gpu_idle_frac', 0):.2%}")
        rows.append(decode_phase(shapes("qwen3-0.6b"), e, bw))
    for tag in ("_base", ""):
        gp, gm = load(out, "gemma_plain" + tag), load(out, "gemma_mtp" + tag)
        if gp and gm:
            p, m = gp["engine"], gm["engine"]
            ratio = m["busy_ms_per_step"] / p["busy_ms_per_step"] if p.get("busy_ms_per_step") else float("nan")
            rows.append(f"Gemma-4 9B{tag}: plain step {p['busy_ms_per_step']:.3f} ms, MTP S=3 step "
                        f"{m['busy_ms_per_step']:.3f} ms (draft {m['draft_ms_per_step']:.3f}) = {ratio:.4f}x")
    for name in with_base(out, ["gemma_plain"]):
        g = load(out, name)  # one request: the decode phase is one row a step
        if g:
            rows.append(f"Gemma-4 9B plain, one request ({name}):")
            rows.append(decode_phase(shapes("gemma4-dense-9b"), g["workloads"][0], bw, rows=1))
    for name in with_base(out, ["pair_plain", "pair_mtp"]):
        r = load(out, name)
        mode = name[len("pair_"):]
        if r:
            for w in r["workloads"]:
                rows.append(f"bundled pair {mode:5} c{w['num_prompts']}: {w['output_tok_s']:8.1f} tok/s, "
                            f"accept {w.get('accept_length', 1.0):.2f}, idle {w.get('gpu_idle_frac', 0):.2%}")
    a = load(out, "attention")
    if a:
        for r in a["rows"]:
            if "error" in r:
                rows.append(f"attn {r['backend']:17} {r.get('model', ''):10} ctx {r['ctx']} bs {r['bs']}: "
                            f"{r['error'][:80]}")
            else:
                rows.append(f"attn {r['backend']:17} {r.get('model', ''):10} ctx {r['ctx']:>5} bs {r['bs']:>3}: "
                            f"{r['us']:8.1f} us "
                            f"{r['gb_s']:7.0f} GB/s = {r['frac_of_copy_bw']:.1%} of copy bw")
    text = "\n".join(rows)
    print(text)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
