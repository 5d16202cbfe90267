"""Quality of online FP8 on real text: the bundled tiny-shakespeare pair quantized at load
(``--quantization fp8``, the assistant too; optionally the FP8 KV cache) against the same pair
unquantized, on the held-out prompts (benchmarks/prompts_shakespeare_heldout.txt).

- MTP accept length (S = 3, greedy, 128 new tokens a prompt): the goal is FP8 within 0.1 of
  the unquantized pair's;
- an lm-eval-style loglikelihood on 40 items (each a held-out prompt cut into a context and a
  continuation; 24 cut at half their tokens, 16 at two thirds): the continuation's summed
  log-probability given the context, and whether it is the greedy continuation, from the
  engine's prompt logprobs. Bound: the mean |change| per continuation token stays under 16x
  what bf16 moves it against float32 on the same items (e4m3 keeps 4 significant bits, bf16 8:
  a rounding 16x as coarse), measured in the same run.

    python benchmarks/fp8_quality.py [--device cpu] [--dtype bfloat16] [--json OUT]

Every engine is ``tandem.LLM`` (real scheduler + worker processes; benchmarks/offline.py's
``start_engine``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.offline import run_engine, start_engine  # noqa: E402
from tandem import SamplingParams  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = os.path.join(ROOT, "models", "tiny-shakespeare")
PROMPTS = os.path.join(ROOT, "benchmarks", "prompts_shakespeare_heldout.txt")
MTP = ["--speculative-algorithm", "FROZEN-KV-MTP", "--speculative-draft-model-path", os.path.join(PAIR, "assistant"),
       "--speculative-num-steps", "3"]
ITEMS = 40
CONT_TOKENS = 6  # continuation length at most: a phrase, as lm-eval's multiple-choice items


def texts() -> list[str]:
    with open(PROMPTS) as f:
        return [ln.rstrip("\n").replace("\\n", "\n") for ln in f if ln.strip()]


def tokenize(lines: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(PAIR, "target", "tokenizer.json"))
    return [tok.encode(t).ids for t in lines]


def items(ids: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs: every prompt cut at half its tokens, then the first 16 at
    two thirds."""
    out = []
    for i in range(ITEMS):
        t = ids[i % len(ids)]
        cut = len(t) // 2 if i < len(ids) else 2 * len(t) // 3
        out.append((t[:cut], t[cut: cut + CONT_TOKENS]))
    return out


def server_argv(device: str, dtype: str, extra: list[str]) -> list[str]:
    return ["--model-path", os.path.join(PAIR, "target"), "--device", device, "--dtype", dtype, "--log-level", "warning",
            "--disable-prefix-cache", "--max-running-requests", "16", *extra]


def accept_length(argv: list[str], prompts: list[list[int]], new: int) -> dict:
    _, llm = start_engine(argv + MTP)
    with llm:
        work = [([np.array(p, dtype=np.int64) for p in prompts], [new] * len(prompts))]
        (summary,) = run_engine(llm, work, 0.0, vary_rounds=False)
    return {"accept_length": summary.get("accept_length"), "output_tok_s": summary["output_tok_s"]}


def loglikelihoods(argv: list[str], pairs) -> list[tuple[float, bool, int, np.ndarray]]:
    """Per item: (summed log-probability of the continuation, whether it is greedy, its tokens,
    the engine's top token at each of its positions)."""
    _, llm = start_engine(argv)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, ignore_eos=True, detokenize=False)
    with llm:
        outs = llm.generate([{"prompt_token_ids": ctx + cont} for ctx, cont in pairs], params, use_tqdm=False)
    result = []
    for (ctx, cont), o in zip(pairs, outs):
        rows = o.prompt_logprobs[len(ctx):]  # row i predicts prompt token i (row 0 is None)
        lp = [row[t].logprob for row, t in zip(rows, cont)]
        top = np.array([next(t for t, x in row.items() if x.rank == 1) for row in rows])
        result.append((float(sum(lp)), bool((top == np.array(cont)).all()), len(cont), top))
    return result


def compare(ref, got) -> dict:
    d = np.array([g[0] - r[0] for r, g in zip(ref, got)])
    tokens = sum(r[2] for r in ref)
    return {"mean_abs_delta_per_item": float(np.abs(d).mean()), "max_abs_delta_per_item": float(np.abs(d).max()),
            "mean_abs_delta_per_token": float(np.abs(d).sum() / tokens), "mean_delta_per_item": float(d.mean()),
            "is_greedy_ref": sum(r[1] for r in ref), "is_greedy": sum(g[1] for g in got),
            "is_greedy_same": sum(r[1] == g[1] for r, g in zip(ref, got)),
            "top1_same": float(np.mean(np.concatenate([r[3] == g[3] for r, g in zip(ref, got)])))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", help="the unquantized baseline's dtype (FP8 runs use it too)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ids = tokenize(texts())
    pairs = items(ids)
    base = server_argv(a.device, a.dtype, [])
    fp8 = server_argv(a.device, a.dtype, ["--quantization", "fp8"])
    fp8kv = server_argv(a.device, a.dtype, ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"])
    res: dict = {"device": a.device, "dtype": a.dtype, "items": len(pairs), "accept": {}, "loglik": {}}
    for name, argv in (("base", base), ("fp8", fp8), ("fp8kv", fp8kv)):
        res["accept"][name] = accept_length(argv, ids, a.new_tokens)
    ll = {name: loglikelihoods(argv, pairs) for name, argv in
          (("float32", server_argv(a.device, "float32", [])), ("base", base), ("fp8", fp8), ("fp8kv", fp8kv))}
    yard = compare(ll["float32"], ll["base"])
    res["loglik"]["base_vs_float32"] = yard
    bound = 16 * yard["mean_abs_delta_per_token"]
    res["loglik"]["bound_per_token"] = bound
    for name in ("fp8", "fp8kv"):
        res["loglik"][f"{name}_vs_base"] = compare(ll["base"], ll[name])
    res["loglik"]["base_sum"] = float(sum(x[0] for x in ll["base"]))
    acc = res["accept"]
    print(f"accept length (S=3, {len(ids)} held-out prompts, {a.new_tokens} tokens, {a.dtype}): "
          f"base {acc['base']['accept_length']:.3f}, FP8 {acc['fp8']['accept_length']:.3f} "
          f"(diff {acc['fp8']['accept_length'] - acc['base']['accept_length']:+.3f}, goal within 0.1), "
          f"FP8 + FP8 KV {acc['fp8kv']['accept_length']:.3f}")
    print(f"loglikelihood, {len(pairs)} items: {a.dtype} vs float32 mean |delta| {yard['mean_abs_delta_per_token']:.4f} "
          f"nats/token -> bound for FP8 {bound:.4f}")
    for name in ("fp8", "fp8kv"):
        c = res["loglik"][f"{name}_vs_base"]
        ok = "within" if c["mean_abs_delta_per_token"] < bound else "PAST"
        print(f"  {name:6} vs {a.dtype}: mean |delta| {c['mean_abs_delta_per_token']:.4f} nats/token ({ok} the bound), "
              f"per item mean {c['mean_abs_delta_per_item']:.3f} max {c['max_abs_delta_per_item']:.3f} "
              f"(mean signed {c['mean_delta_per_item']:+.3f}); is_greedy {c['is_greedy']}/{len(pairs)} "
              f"vs {c['is_greedy_ref']}/{len(pairs)}, same verdict on {c['is_greedy_same']}; the same top "
              f"token at {c['top1_same']:.1%} of the continuation positions")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
