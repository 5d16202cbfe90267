"""Offline throughput: ``tandem.LLM`` (the engine's processes, no HTTP), nano-vllm style,
beside HF transformers.

Generates N requests of random token ids (ignore_eos, fixed lengths, ``detokenize=False``: token
ids only, as nano-vllm's bench) through ``LLM.generate`` and measures output tokens / wall time.
With --hf it also times HF ``generate`` on the same model and workload in the same run. Flags it
does not know are ``tandem serve``'s (the engine arguments).

    python benchmarks/offline.py --model-path DIR --device cpu --num-prompts 32 \
        --input-len 128 --output-len 64 [--hf] [--speculative-draft-model-path DRAFT]

``--num-prompts 1,64`` runs several workloads on one engine start (one JSON entry each, under
``workloads``; the first is also ``engine``). ``--input-len-range LO HI`` / ``--output-len-range
LO HI`` draw each request's lengths uniformly (nano-vllm's recipe: 256 requests, both in
[100, 1024]). Per workload it reports tok/s, step timing, and the device's busy and idle time
between steps (``gpu_idle_frac``: idle / (busy + idle)) from the worker's CUDA events.
``--prefill-prompts N --prefill-len L`` adds a prefill-bound workload last (N prompts of L
tokens, one output token each: ``prefill.input_tok_s``); ``kv_pool_tokens`` is the KV pool's size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.procfs import engine_cpu_seconds  # noqa: E402
from common.args import ServerArgs  # noqa: E402
from common.serve_cli import parse_server_args  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402


def start_engine(server_argv: list[str]) -> tuple[ServerArgs, LLM]:
    args = parse_server_args(server_argv)
    engine_args = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs) if f.name != "model_path"}
    return args, LLM(args.model_path, **engine_args)


def run_engine(llm: LLM, workloads: list[tuple[list[np.ndarray], list[int]]], temperature: float,
               repeat: int = 1, warmup: int = 0, vary_rounds: bool = True) -> list[dict]:
    first = workloads[0][0][0]
    warm = SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True, detokenize=False)
    llm.generate({"prompt_token_ids": first[:8].tolist()}, warm, use_tqdm=False)
    stats = llm.engine_stats()
    results = []
    for prompts, out_lens in workloads:
        walls, before, cpu0 = [], stats, engine_cpu_seconds(os.getpid())
        for k in range(-warmup, repeat):  # rounds of the same workload; the median round is reported
            if k == 0:  # warm-up rounds (k < 0) are not counted
                walls, before, cpu0 = [], stats, engine_cpu_seconds(os.getpid())
            batch = []
            for p in prompts:
                # Random-id prompts differ between rounds in their first tokens, so that no round
                # reads another's KV from the prefix cache. Text prompts stay as they are (their
                # acceptance rates are the point): pass --disable-prefix-cache for such rounds.
                if vary_rounds and k:
                    p = np.roll(p, k) if k > 0 else p[::-1]
                batch.append({"prompt_token_ids": p.tolist()})
            params = [SamplingParams(max_tokens=int(n), temperature=temperature, ignore_eos=True, detokenize=False)
                      for n in out_lens]
            t0 = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            walls.append(time.perf_counter() - t0)
            n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            stats = llm.engine_stats()
        results.append(_summary(walls, n_tokens, before, stats, repeat))
        # CPU seconds of each engine process over the timed rounds, per step: on a machine other
        # work shares, steadier than wall time (which also counts waiting for a core).
        steps = max(stats.steps - (before.steps if before is not None else 0), 1) if stats is not None else 1
        results[-1]["cpu_ms_per_step"] = {role: round(1e3 * (cpu - cpu0.get(role, 0.0)) / steps, 3)
                                          for role, cpu in engine_cpu_seconds(os.getpid()).items()}
    return results


def _summary(walls, n_tokens, before, stats, repeat) -> dict:
    wall = float(np.median(walls))
    out = {"wall_s": wall, "output_tokens": n_tokens, "output_tok_s": n_tokens / wall,
           "round_tok_s": [round(n_tokens / w, 1) for w in walls]}
    if stats is None:
        return out

    def d(attr):
        return getattr(stats, attr) - (getattr(before, attr) if before is not None else 0)

    steps = max(d("steps"), 1)
    busy, gap = d("worker_busy_s"), d("worker_gap_s")
    out.update(steps=d("steps") // repeat, draft_ms_per_step=1e3 * d("worker_draft_s") / steps,
               forward_ms_per_step=1e3 * d("worker_forward_s") / steps,
               scheduler_ms_per_step=1e3 * d("step_time_s") / steps,
               busy_ms_per_step=1e3 * busy / steps, idle_ms_per_step=1e3 * gap / steps,
               gpu_idle_frac=gap / (busy + gap) if busy + gap > 0 else 0.0)
    dsteps, dbusy = d("decode_steps"), d("decode_busy_s")
    if dsteps and dbusy > 0:  # the decode phase alone: what a step roofline is compared against
        out.update(decode_steps=dsteps, decode_busy_ms_per_step=1e3 * dbusy / dsteps,
                   decode_tok_s=d("decode_tokens") / dbusy, decode_tokens_per_step=d("decode_tokens") / dsteps,
                   decode_ctx_tokens_per_step=d("decode_ctx_tokens") / dsteps)
    drafts = d("spec_num_drafts")
    if drafts:
        out["accept_length"] = 1 + d("spec_num_accepted_tokens") / drafts
        prev = before.spec_accepted_per_pos if before is not None else ()
        out["accepted_per_pos"] = [(x - (prev[i] if i < len(prev) else 0)) / drafts
                                   for i, x in enumerate(stats.spec_accepted_per_pos)]
    return out


def run_hf(model_dir: str, prompts: list[np.ndarray], output_len: int, device: str, batch: int,
           repeat: int = 1, load_format: str = "auto") -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if load_format == "dummy":  # random weights of the config's shapes, built on the device
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    gen = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    if len({len(p) for p in prompts}) > 1:
        batch = 1  # no padding games: unequal prompts run one at a time
    walls, cpus = [], []
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0][:8]], device=device), max_new_tokens=2)  # warm-up
        for _ in range(repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            n = 0
            for i in range(0, len(prompts), batch):
                chunk = torch.tensor(np.stack(prompts[i : i + batch]), device=device)
                out = model.generate(chunk, attention_mask=torch.ones_like(chunk), **gen)
                n += (out.shape[1] - chunk.shape[1]) * chunk.shape[0]
            if device != "cpu":
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    wall = float(np.median(walls))
    return {"wall_s": wall, "output_tokens": n, "output_tok_s": n / wall,
            "round_tok_s": [round(n / w, 1) for w in walls], "threads": torch.get_num_threads(),
            "cpu_ms_per_token": round(1e3 * float(np.median(cpus)) / n, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", default="32", help="comma list: one workload per entry, one engine start")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--input-len-range", type=int, nargs=2, default=None, metavar=("LO", "HI"))
    ap.add_argument("--output-len-range", type=int, nargs=2, default=None, metavar=("LO", "HI"))
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="timed rounds; the median is reported")
    ap.add_argument("--warmup-rounds", type=int, default=0, help="untimed rounds of each workload first")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers generate")
    ap.add_argument("--hf-batch", type=int, default=0, help="HF generate batch (default: all prompts at once)")
    ap.add_argument("--hf-num-prompts", type=int, default=0, help="HF: only the first N prompts (bounds its time)")
    ap.add_argument("--hf-output-len", type=int, default=0, help="HF: new tokens per prompt (default: as the engine)")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--prompts-file", default=None, help="text prompts, one per line (cycled); default random ids")
    ap.add_argument("--prefill-prompts", type=int, default=0, help="a last, prefill-bound workload of N prompts")
    ap.add_argument("--prefill-len", type=int, default=2048, help="its prompt length (one output token each)")
    bench, server_argv = ap.parse_known_args()
    args, llm = start_engine(server_argv)
    counts = [int(x) for x in str(bench.num_prompts).split(",")]
    workloads = [make_workload(bench, args, n, i) for i, n in enumerate(counts)]
    if bench.prefill_prompts:
        rng = np.random.default_rng(bench.seed + len(counts))
        workloads.append(([rng.integers(3, _vocab(args.model_path), bench.prefill_len)
                           for _ in range(bench.prefill_prompts)], [1] * bench.prefill_prompts))
    with llm:
        runs = run_engine(llm, workloads, bench.temperature, bench.repeat, bench.warmup_rounds,
                          vary_rounds=bench.prompts_file is None)
        stats = llm.engine_stats()
    results = {"workload": vars(bench), "engine": runs[0],
               "kv_pool_tokens": stats.kv_pages_total * args.page_size if stats is not None else None,
               "workloads": [{"num_prompts": n, **r} for n, r in zip(counts, runs)]}
    if bench.prefill_prompts:
        wall = runs[-1]["wall_s"]
        results["prefill"] = {"num_prompts": bench.prefill_prompts, "input_len": bench.prefill_len, "wall_s": wall,
                              "input_tok_s": bench.prefill_prompts * bench.prefill_len / wall}
    if bench.hf:
        prompts = workloads[0][0][: bench.hf_num_prompts or None]
        if bench.input_len_range:  # HF batches equal lengths: use the mean length for all
            prompts = [np.resize(p, (bench.input_len_range[0] + bench.input_len_range[1]) // 2) for p in prompts]
        results["hf_transformers"] = run_hf(args.model_path, prompts, bench.hf_output_len or bench.output_len,
                                            args.resolved_device(), bench.hf_batch or len(prompts), bench.repeat,
                                            load_format=args.load_format)
    print(json.dumps(results, indent=2))
    if bench.json:
        with open(bench.json, "w") as f:
            json.dump(results, f, indent=2)


def make_workload(bench, args, n: int, salt: int) -> tuple[list[np.ndarray], list[int]]:
    rng = np.random.default_rng(bench.seed + salt)
    if bench.input_len_range:
        lo, hi = bench.input_len_range
        vocab = _vocab(args.model_path)
        prompts = [rng.integers(3, vocab, int(rng.integers(lo, hi + 1))) for _ in range(n)]
    else:
        prompts = make_prompts(bench, args, n, rng)
    if bench.output_len_range:
        lo, hi = bench.output_len_range
        outs = [int(x) for x in rng.integers(lo, hi + 1, n)]
    else:
        outs = [bench.output_len] * n
    return prompts, outs


def make_prompts(bench, args, n: int, rng) -> list[np.ndarray]:
    if bench.prompts_file:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(args.tokenizer_dir, "tokenizer.json"))
        with open(bench.prompts_file) as f:
            lines = [ln.rstrip("\n").replace("\\n", "\n") for ln in f if ln.strip()]
        ids = [np.array(tok.encode(t).ids[: bench.input_len], dtype=np.int64) for t in lines]
        return [ids[i % len(ids)] for i in range(n)]
    vocab = _vocab(args.model_path)
    return [rng.integers(3, vocab, bench.input_len) for _ in range(n)]


def _vocab(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return int(cfg.get("text_config", cfg)["vocab_size"])


if __name__ == "__main__":
    main()
