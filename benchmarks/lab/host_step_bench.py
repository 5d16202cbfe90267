"""The worker's host half of a decode step, timed on the host alone (no device needed).

Small models are host-bound on a GPU: their step cycle is mostly the worker's host work, of
which ``ModelRunner.prepare`` (slot frees, host mirrors, the typed inputs and their upload, the
graph bucket's slot check) is a large part (``TANDEM_HOST_TIMING=1``'s ``l.prepare``). This
times ``prepare`` for a steady decode-only plan (the bucket already holds its slots, as in a
running batch) on a runner built here, with CUDA graphs emulated on the CPU (the same host code
as on the GPU; only the upload differs), so host-side changes can be measured where they are
written. Between two timed calls it touches ``--evict-mb`` of memory, as a step's other work
does (a tight loop with warm caches reads ~3x faster than the same code inside a running engine):

    python benchmarks/lab/host_step_bench.py [--rows 1 8] [--iters 3000] [--evict-mb 16]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TANDEM_EMULATE_CUDA_GRAPHS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from gpu_worker.main import build_runner  # noqa: E402
from common.args import ServerArgs  # noqa: E402
from gpu_worker.step.timer import StepTimer  # noqa: E402
from proto.messages import StepPlan  # noqa: E402


def time_prepare(runner, rows: int, iters: int, evict_mb: int) -> list[float]:
    slots = np.arange(1, rows + 1, dtype=np.int32)
    plan = StepPlan(step_id=1, decode_slots=slots.tobytes())
    bucket = runner.graphs.bucket(rows)
    pad = np.zeros(bucket, dtype=np.int64)
    pad[:rows] = slots
    runner.graphs._held[bucket] = pad  # a running batch: its bucket holds these slots
    out = []
    junk = np.ones(evict_mb << 17)  # float64: evict_mb MiB
    gc.disable()
    try:
        for _ in range(iters):
            if evict_mb:
                junk += 1.0  # the rest of a step runs between two stages: caches are not warm
            t0 = time.perf_counter()
            runner.prepare(plan, StepTimer(runner.device, None))
            out.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default="models/tiny-shakespeare/target")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--evict-mb", type=int, default=16, help="memory touched between two stages (0: warm caches)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    args = ServerArgs(model_path=a.model_path, device="cpu", attention_backend="triton", log_level="warning",
                      cuda_graph_bs=tuple(sorted(set(a.rows))), max_running_requests=max(a.rows))
    runner, _ = build_runner(args)
    res = {}
    for r in a.rows:
        t = time_prepare(runner, r, a.iters, a.evict_mb)[a.iters // 10:]  # the first tenth: warm-up
        res[r] = {"median_us": statistics.median(t) * 1e6, "mean_us": statistics.fmean(t) * 1e6}
        print(f"{r} rows: prepare() median {res[r]['median_us']:.1f} us, mean {res[r]['mean_us']:.1f} us "
              f"({a.evict_mb} MiB touched between stages)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"prepare_us": res}, f, indent=1)


if __name__ == "__main__":
    main()
