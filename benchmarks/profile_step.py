"""Where a decode step's time goes: torch.profiler over the in-process engine (scheduler core +
worker runner, no sockets) on a model (dummy weights unless ``--load-format auto``), ``--batch`` rows.

    python benchmarks/profile_step.py --model-path DIR [--batch 64] [--steps 32] [--trace OUT.json.gz]

With ``--decode-only`` every row is prefilled before the profiler starts and exactly ``--steps``
decode steps are profiled (the batch-64 / batch-256 regime); otherwise the profiled span is one
prefill step and ``steps - 1`` decode steps of one fresh batch.

Prints per step: host API calls that launch work (kernels, graph replays, copies), GPU kernel
time, and the top operators by self CUDA and self CPU time. Re-run it after every change to the
hot path (the numbers it prints go into the notes beside BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import logging
import os
import sys
import time
import warnings
import zlib

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tandem.inproc import InProcEngine  # noqa: E402

LAUNCH_APIS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch",
               "cudaMemcpyAsync")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--disable-piecewise-cuda-graph", action="store_true", help="prefill steps eager")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--quantization", default=None, help="as tandem serve's flag (fp8: online FP8 weights)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--load-format", default="dummy", help="auto: the checkpoint's own weights (dummy: random)")
    ap.add_argument("--decode-only", action="store_true", help="profile decode steps only")
    ap.add_argument("--sync-debug", action="store_true", help="list host syncs in the profiled steps")
    ap.add_argument("--cprofile", action="store_true",
                    help="host side instead: cProfile of one prefill step (Python time by function), repeated 3x")
    a = ap.parse_args()
    if a.cprofile:  # start-up lines too: prefill warm-up, graph capture (buckets, seconds, memory)
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    eng = InProcEngine(a.model_path, draft=a.draft, device=a.device, load_format=a.load_format,
                       attention_backend=a.attention_backend, disable_cuda_graph=a.disable_cuda_graph,
                       disable_piecewise_cuda_graph=a.disable_piecewise_cuda_graph,
                       max_running_requests=max(8, a.batch), context_length=a.input_len + a.steps + 64,
                       overlap=not a.no_overlap, quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype)
    vocab = eng.ready.vocab_size
    def prompt(tag: str, r: int) -> list[int]:
        # Distinct per request: a shared prompt would hit the prefix cache (no prefill to profile)
        # and let every row's attention read the same pages from L2.
        salt = {"warm": 0, "p": 104729}.get(tag, zlib.crc32(tag.encode()) % 65521 + 1)
        off = 7919 * r + salt
        return [(17 * i + off) % (vocab - 10) + 5 for i in range(a.input_len)]

    def batch(tag, n_new):
        for r in range(a.batch):
            eng.submit(f"{tag}{r}", prompt(tag, r), max_new_tokens=n_new, ignore_eos=True)
        eng.run()

    batch("warm", 8)
    if a.cprofile:
        host_profile(eng, batch, a.device)
        return
    if a.decode_only:  # prefill every row, then profile the next `steps` results
        for r in range(a.batch):
            eng.submit(f"p{r}", prompt("p", r), max_new_tokens=a.steps + 8, ignore_eos=True)
        eng.run(until=lambda: all(eng.tokens[f"p{r}"] for r in range(a.batch)))
        done = eng.core.counters.steps
        profiled = dict(until=lambda: eng.core.counters.steps >= done + a.steps)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if a.sync_debug:
            torch.cuda.set_sync_debug_mode(1)
        if a.decode_only:
            eng.run(**profiled)
        else:
            batch("p", a.steps)  # one prefill step, then steps - 1 decode steps
        if a.sync_debug:
            torch.cuda.set_sync_debug_mode(0)
        sync()
    wall = time.perf_counter() - t0
    if a.decode_only:
        eng.run()
    syncs = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    if a.sync_debug:
        print("host syncs in the profiled steps:", json.dumps(syncs.most_common(20), indent=1))
    report(prof, a.steps, wall)
    if a.trace:
        prof.export_chrome_trace("/tmp/_trace.json")
        with open("/tmp/_trace.json", "rb") as f, gzip.open(a.trace, "wb") as g:
            g.write(f.read())


def host_profile(eng, batch, device: str) -> None:
    """Where the host's time goes in an eager prefill step (one step of ``batch`` x input-len
    tokens, then one decode step): wall time without a profiler, then cProfile's top functions.
    The torch profiler shows operators and driver calls but not the Python between them."""
    import cProfile
    import pstats

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    walls = []
    for i in range(3):
        sync()
        t0 = time.perf_counter()
        batch(f"h{i}_", 2)
        sync()
        walls.append(1e3 * (time.perf_counter() - t0))
    print(json.dumps({"prefill_plus_one_decode_ms": [round(w, 2) for w in walls]}))
    prof = cProfile.Profile()
    sync()
    prof.enable()
    batch("cp_", 2)
    sync()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)


def report(prof, steps: int, wall: float) -> None:
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in LAUNCH_APIS)
    gpu_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events)
    out = {"steps": steps, "wall_ms_per_step": 1e3 * wall / steps, "launch_calls_per_step": launches / steps,
           "gpu_kernel_ms_per_step": gpu_us / 1e3 / steps}
    print(json.dumps(out, indent=2))
    print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
