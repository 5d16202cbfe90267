"""Tensor parallelism: TP=1 vs TP=N on an 8B-shaped dummy model, and the all-reduce share.

Each rank is one process (as under `tandem serve --tp-size N`) running the real worker
runner and its own copy of the scheduler core (deterministic: every rank plans the same
steps, so no sockets are needed to drive them). Per batch size it admits B requests of
--input-len random tokens, prefills them, then times --output-len decode steps (at the
engine's default overlap depth, as the worker runs). Then rank 0 profiles --profile-steps decode steps with
torch.profiler and reports the share of device time spent in collectives (NCCL kernels on
CUDA, gloo ops on the CPU).

    python benchmarks/tp.py --device cuda --tp 1 2 --batch 1 64 --json out.json   # needs 2 GPUs
    python benchmarks/tp.py --device cpu --shape tiny --tp 1 2 --batch 1 4         # smoke test
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {  # Llama-3-8B (HF config values), and a tiny one for a CPU smoke run
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=4096, rope_theta=10000.0, rms_norm_eps=1e-5),
}


def write_config(shape: str, out_dir: str) -> str:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 8192,
           "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 2, **SHAPES[shape]}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out_dir


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drive(runner, core, planner, device, steps: int | None = None) -> tuple[int, int]:
    """Plan/launch/result at the default overlap depth until idle (or ``steps`` plans);
    -> (plans, tokens out)."""
    from common.args import ServerArgs

    depth = ServerArgs.overlap_depth
    pending: deque = deque()
    plans = tokens = 0
    while not core.idle() and (steps is None or plans < steps):
        while len(core.inflight) < depth and (plan := planner.plan()) is not None:
            pending.append(runner.launch(plan))
            plans += 1
        if pending:
            core.on_result(pending.popleft().result())
        tokens += sum(len(o.token_ids) // 4 for o in core.take_outputs())
    while pending:
        core.on_result(pending.popleft().result())
    return plans, tokens


def _submit(core, b: int, input_len: int, output_len: int, vocab: int, tag: str) -> None:
    import numpy as np

    from proto.messages import GenerateReq, SamplingParams

    rng = np.random.default_rng(0)  # same prompts on every rank
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(b):
        ids = rng.integers(10, vocab - 10, input_len).astype(np.int32)
        core.add_request(GenerateReq(f"{tag}{i}", ids.tobytes(), params, time.time()))


def _collective_share(prof, cuda: bool) -> dict:
    """Collective time vs the profiled steps, in ms. CUDA: NCCL kernel time over all kernel
    time (busy) and over the steps' wall time; CPU: gloo collective time over wall time."""
    coll = kernels = wall = 0.0
    for ev in prof.key_averages():
        name = ev.key.lower()
        if name == "step":
            wall += ev.cpu_time_total
        elif cuda:
            t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)
            kernels += t
            coll += t if "nccl" in name else 0.0
        elif name.startswith("gloo:"):  # the collective itself, timed on gloo's thread
            coll += ev.cpu_time_total
    return {"collective_ms": coll / 1e3, "kernel_ms": kernels / 1e3 if cuda else None, "wall_ms": wall / 1e3,
            "share": coll / (kernels if cuda else wall) if (kernels if cuda else wall) else None,
            "share_of_wall": coll / wall if wall else None}


def rank_main(rank: int, tp: int, init: str, opts: dict, out) -> None:
    try:
        import torch

        from gpu_worker.main import build_runner
        from gpu_worker.parallel.state import destroy_tp, init_tp
        from common.args import ServerArgs
        from scheduler_proc.core import SchedConfig, SchedulerCore
        from scheduler_proc.planner import Planner

        dev = torch.device(opts["device"])
        init_tp(rank, tp, init, dev)
        args = ServerArgs(model_path=opts["model"], device=opts["device"], load_format="dummy", dtype=opts["dtype"],
                          tp_size=tp, max_running_requests=max(opts["batch"]), num_threads=opts["threads"],
                          context_length=opts["input_len"] + opts["output_len"] + 64,
                          max_total_tokens=max(opts["batch"]) * (opts["input_len"] + opts["output_len"] + 64))
        runner, ready = build_runner(args)
        core = SchedulerCore(SchedConfig.from_ready(ready, args))
        planner = Planner(core)
        device = runner.device
        res = {}
        _submit(core, 2, 16, 4, ready.vocab_size, "warm")
        _drive(runner, core, planner, device)
        for b in opts["batch"]:
            _submit(core, b, opts["input_len"], opts["output_len"], ready.vocab_size, f"b{b}-")
            _sync(device)
            # prefill: until every request has its first token (one chunk each at these sizes)
            t0 = time.perf_counter()
            while core.waiting or any(not r.output_ids for r in core.running):
                _drive(runner, core, planner, device, steps=1)
            _sync(device)
            t1 = time.perf_counter()
            prof_steps = min(opts["profile_steps"], max(opts["output_len"] - 8, 0))
            plans, toks = _drive(runner, core, planner, device, steps=opts["output_len"] - 1 - prof_steps)
            _sync(device)
            t2 = time.perf_counter()
            share = None
            if prof_steps:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if device.type == "cuda":
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=acts) as prof:
                    for _ in range(prof_steps):
                        with torch.profiler.record_function("step"):
                            _drive(runner, core, planner, device, steps=1)
                            _sync(device)
                share = _collective_share(prof, device.type == "cuda")
            _drive(runner, core, planner, device)  # drain
            res[b] = {"prefill_s": t1 - t0, "decode_steps": plans, "decode_s": t2 - t1,
                      "decode_ms_per_step": 1e3 * (t2 - t1) / max(plans, 1),
                      "output_tok_s": toks / (t2 - t1) if t2 > t1 else None, "allreduce": share}
        destroy_tp()
        out.put((rank, "ok", res))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def run_tp(tp: int, opts: dict) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "store")
        procs = [ctx.Process(target=rank_main, args=(r, tp, init, opts, out)) for r in range(tp)]
        for p in procs:
            p.start()
        results = {}
        while len(results) < tp:
            rank, status, value = out.get(timeout=opts["timeout"])
            if status != "ok":
                for p in procs:
                    p.kill()
                raise SystemExit(f"tp={tp} rank {rank} failed:\n{value}")
            results[rank] = value
        for p in procs:
            p.join(30)
    return results[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank (CPU runs)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--write-config", default=None, metavar="DIR",
                    help="only write the --shape config.json into DIR (for offline.py --load-format dummy)")
    a = ap.parse_args()
    if a.write_config:
        os.makedirs(a.write_config, exist_ok=True)
        print(os.path.join(write_config(a.shape, a.write_config), "config.json"))
        return
    with tempfile.TemporaryDirectory() as model:
        opts = dict(device=a.device, dtype=a.dtype, model=write_config(a.shape, model), batch=a.batch,
                    input_len=a.input_len, output_len=a.output_len, profile_steps=a.profile_steps,
                    threads=a.threads, timeout=a.timeout)
        report = {"shape": a.shape, "device": a.device, "input_len": a.input_len, "output_len": a.output_len,
                  "runs": {str(tp): run_tp(tp, opts) for tp in a.tp}}
    print(f"{'tp':>3} {'batch':>6} {'decode ms/step':>15} {'tok/s':>9} {'allreduce share':>16}")
    for tp, runs in report["runs"].items():
        for b, r in runs.items():
            ar = r["allreduce"]
            share = f"{100 * ar['share']:.1f}%" if ar and ar["share"] is not None else "-"
            print(f"{tp:>3} {b:>6} {r['decode_ms_per_step']:15.2f} {r['output_tok_s'] or 0:9.1f} {share:>16}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
