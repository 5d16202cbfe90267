"""Offline throughput: the engine without HTTP, nano-vllm style, beside HF transformers.

Starts the scheduler and worker processes, pushes N requests of random token ids straight onto
the requests channel (ignore_eos, fixed lengths), and measures output tokens / wall time.
With --hf it also times HF ``generate`` on the same model and workload in the same run.

    python benchmarks/offline.py --model-path DIR --device cpu --num-prompts 32 \
        --input-len 128 --output-len 64 [--hf] [--speculative-draft-model-path DRAFT]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from proto.args import parse_server_args  # noqa: E402
from proto.messages import EngineInfo, GenerateReq, SamplingParams, SchedulerStats, Shutdown, StepOutputs  # noqa: E402
from proto.transport import AsyncPullChannel, PullChannel, PushChannel, ipc_endpoints, make_run_dir  # noqa: E402,F401
from tandem.child import child_main  # noqa: E402
from tandem.supervisor import worker_roles  # noqa: E402


def start_engine(server_argv: list[str]):
    args = parse_server_args(server_argv)
    ep = ipc_endpoints(make_run_dir())
    ctx = mp.get_context("spawn")
    init = "file://" + os.path.join(make_run_dir(), "tp.store")  # TP ranks' rendezvous (--tp-size)
    procs = [ctx.Process(target=child_main, args=(role, args, ep, None), kwargs={"rank": r, "init_method": init})
             for r, role in enumerate(worker_roles(args.tp_size))]
    procs.append(ctx.Process(target=child_main, args=("scheduler", args, ep, None)))
    for p in procs:
        p.start()
    return args, ep, procs


def run_engine(ep, prompts: list[np.ndarray], output_len: int, temperature: float, procs, repeat: int = 1) -> dict:
    zctx = zmq.Context()
    outputs = PullChannel(zctx, "outputs", ep.outputs)
    requests = PushChannel(zctx, "requests", ep.requests)
    while not isinstance(outputs.recv(timeout_ms=1000), EngineInfo):
        if not all(p.is_alive() for p in procs):
            raise SystemExit("engine failed to start (see the log above)")
    params = SamplingParams(max_new_tokens=output_len, temperature=temperature, ignore_eos=True)
    # Warm-up request (not timed).
    requests.send(GenerateReq("warmup", prompts[0][:8].astype(np.int32).tobytes(), params, time.time()))
    _collect(outputs, {"warmup"})
    walls = []
    for k in range(repeat):  # rounds of the same workload; the median round is reported
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            requests.send(GenerateReq(f"b{k}-{i}", p.astype(np.int32).tobytes(), params, time.time()))
        n_tokens, stats = _collect(outputs, {f"b{k}-{i}" for i in range(len(prompts))})
        walls.append(time.perf_counter() - t0)
    wall = float(np.median(walls))
    requests.send(Shutdown("benchmark done"))
    time.sleep(0.5)
    outputs.close()
    requests.close()
    zctx.term()
    out = {"wall_s": wall, "output_tokens": n_tokens, "output_tok_s": n_tokens / wall,
           "round_tok_s": [round(n_tokens / w, 1) for w in walls]}
    if stats is not None:
        steps = max(stats.steps, 1)
        out.update(steps=stats.steps, draft_ms_per_step=1e3 * stats.worker_draft_s / steps,
                   forward_ms_per_step=1e3 * stats.worker_forward_s / steps,
                   scheduler_ms_per_step=1e3 * stats.step_time_s / steps)
        if stats.spec_num_drafts:
            out["accept_length"] = 1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts
            out["accepted_per_pos"] = [x / stats.spec_num_drafts for x in stats.spec_accepted_per_pos]
    return out


def _collect(outputs, rids: set[str]):
    n, stats = 0, None
    pending = set(rids)
    while pending:
        msg = outputs.recv()
        if isinstance(msg, SchedulerStats):
            stats = msg
        elif isinstance(msg, StepOutputs):
            for o in msg.outputs:
                if o.rid in rids:
                    n += len(o.token_ids) // 4
                    if o.finish_reason:
                        pending.discard(o.rid)
    return n, stats


def run_hf(model_dir: str, prompts: list[np.ndarray], output_len: int, device: str, batch: int,
           repeat: int = 1) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    gen = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    if len({len(p) for p in prompts}) > 1:
        batch = 1  # no padding games: unequal prompts run one at a time
    walls = []
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0][:8]], device=device), max_new_tokens=2)  # warm-up
        for _ in range(repeat):
            t0 = time.perf_counter()
            n = 0
            for i in range(0, len(prompts), batch):
                chunk = torch.tensor(np.stack(prompts[i : i + batch]), device=device)
                out = model.generate(chunk, attention_mask=torch.ones_like(chunk), **gen)
                n += (out.shape[1] - chunk.shape[1]) * chunk.shape[0]
            if device != "cpu":
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
    wall = float(np.median(walls))
    return {"wall_s": wall, "output_tokens": n, "output_tok_s": n / wall,
            "round_tok_s": [round(n / w, 1) for w in walls]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="timed rounds; the median is reported")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers generate")
    ap.add_argument("--hf-batch", type=int, default=0, help="HF generate batch (default: all prompts at once)")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--prompts-file", default=None, help="text prompts, one per line (cycled); default random ids")
    bench, server_argv = ap.parse_known_args()
    args, ep, procs = start_engine(server_argv)
    prompts = make_prompts(bench, args)
    results = {"workload": vars(bench), "engine": run_engine(ep, prompts, bench.output_len, bench.temperature, procs, bench.repeat)}
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.terminate()
    if bench.hf:
        results["hf_transformers"] = run_hf(args.model_path, prompts, bench.output_len, args.resolved_device(),
                                            bench.hf_batch or bench.num_prompts, bench.repeat)
    print(json.dumps(results, indent=2))
    if bench.json:
        with open(bench.json, "w") as f:
            json.dump(results, f, indent=2)


def make_prompts(bench, args) -> list[np.ndarray]:
    if bench.prompts_file:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(args.tokenizer_dir, "tokenizer.json"))
        with open(bench.prompts_file) as f:
            lines = [ln.rstrip("\n").replace("\\n", "\n") for ln in f if ln.strip()]
        ids = [np.array(tok.encode(t).ids[: bench.input_len], dtype=np.int64) for t in lines]
        return [ids[i % len(ids)] for i in range(bench.num_prompts)]
    rng = np.random.default_rng(bench.seed)
    vocab = _vocab(args.model_path)
    return [rng.integers(3, vocab, bench.input_len) for _ in range(bench.num_prompts)]


def _vocab(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return int(cfg.get("text_config", cfg)["vocab_size"])


if __name__ == "__main__":
    main()
