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


def start_engine(server_argv: list[str]):
    args = parse_server_args(server_argv)
    ep = ipc_endpoints(make_run_dir())
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=child_main, args=(role, args, ep, None)) for role in ("worker", "scheduler")]
    for p in procs:
        p.start()
    return args, ep, procs


def run_engine(ep, prompts: list[np.ndarray], output_len: int, temperature: float) -> dict:
    zctx = zmq.Context()
    outputs = PullChannel(zctx, "outputs", ep.outputs)
    requests = PushChannel(zctx, "requests", ep.requests)
    while not isinstance(outputs.recv(), EngineInfo):
        pass
    params = SamplingParams(max_new_tokens=output_len, temperature=temperature, ignore_eos=True)
    # Warm-up request (not timed).
    requests.send(GenerateReq("warmup", prompts[0][:8].astype(np.int32).tobytes(), params, time.time()))
    _collect(outputs, {"warmup"})
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        requests.send(GenerateReq(f"b{i}", p.astype(np.int32).tobytes(), params, time.time()))
    n_tokens, stats = _collect(outputs, {f"b{i}" for i in range(len(prompts))})
    wall = time.perf_counter() - t0
    requests.send(Shutdown("benchmark done"))
    time.sleep(0.5)
    outputs.close()
    requests.close()
    zctx.term()
    out = {"wall_s": wall, "output_tokens": n_tokens, "output_tok_s": n_tokens / wall}
    if stats is not None and stats.spec_num_drafts:
        out["accept_length"] = 1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts
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


def run_hf(model_dir: str, prompts: list[np.ndarray], output_len: int, device: str, batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    gen = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    ids = torch.tensor(np.stack(prompts), device=device)
    with torch.no_grad():
        model.generate(ids[:1, :8], max_new_tokens=2)  # warm-up
        t0 = time.perf_counter()
        n = 0
        for i in range(0, len(prompts), batch):
            chunk = ids[i : i + batch]
            out = model.generate(chunk, attention_mask=torch.ones_like(chunk), **gen)
            n += (out.shape[1] - chunk.shape[1]) * chunk.shape[0]
        if device != "cpu":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": n, "output_tok_s": n / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf", action="store_true", help="also time HF transformers generate")
    ap.add_argument("--hf-batch", type=int, default=0, help="HF generate batch (default: all prompts at once)")
    ap.add_argument("--json", default=None, help="write results here")
    bench, server_argv = ap.parse_known_args()
    args, ep, procs = start_engine(server_argv)
    rng = np.random.default_rng(bench.seed)
    vocab = _vocab(args.model_path)
    prompts = [rng.integers(3, vocab, bench.input_len) for _ in range(bench.num_prompts)]
    results = {"workload": vars(bench), "engine": run_engine(ep, prompts, bench.output_len, bench.temperature)}
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.terminate()
    if bench.hf:
        results["hf_transformers"] = run_hf(args.model_path, prompts, bench.output_len, args.resolved_device(),
                                            bench.hf_batch or bench.num_prompts)
    print(json.dumps(results, indent=2))
    if bench.json:
        with open(bench.json, "w") as f:
            json.dump(results, f, indent=2)


def _vocab(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return int(cfg.get("text_config", cfg)["vocab_size"])


if __name__ == "__main__":
    main()
