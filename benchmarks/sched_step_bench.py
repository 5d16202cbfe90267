"""The scheduler's per-step work, timed in one process (no sockets, no device).

Between result N reaching the scheduler and plan N+2 leaving it, the scheduler decodes the
result, emits each row's tokens (``SchedulerCore.on_result``), plans the next step
(``Planner.plan``) and encodes it. On a host-bound GPU step (the small models at a few rows)
that work sits in the step cycle at overlap depth 2; at many rows it grows per row. This times
exactly that, for a steady decode batch of ``--rows`` requests (each row accepting all T
tokens), touching ``--evict-mb`` between steps so the caches are as cold as in a running engine
(the worker's ``host_step_bench.py`` does the same):

    python benchmarks/sched_step_bench.py [--rows 1 8 64 256] [--t 1 4] [--iters 3000]

``benchmarks/sched_roundtrip.py`` adds the sockets and the loop around it (three processes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

from proto.arrays import pack_i32, view_i32  # noqa: E402
from proto.messages import GenerateReq, SamplingParams, StepPlan, StepResult  # noqa: E402
from scheduler_proc.core import SchedConfig, SchedulerCore  # noqa: E402
from scheduler_proc.planner import Planner  # noqa: E402

_enc = msgspec.msgpack.Encoder()


def _result_for(plan: StepPlan, t: int) -> bytes:
    rows = [e.slot for e in plan.extend if e.sample] + view_i32(plan.decode_slots).tolist()
    return _enc.encode(StepResult(step_id=plan.step_id, slots=pack_i32(rows), tokens=pack_i32([7] * (len(rows) * t)),
                                  accept_lens=pack_i32([t] * len(rows))))


def time_steps(rows: int, t: int, iters: int, evict_mb: int) -> list[float]:
    cfg = SchedConfig(page_size=16, num_pages=1 << 20, max_slots=max(rows, 8), tokens_per_step=t,
                      max_context=1 << 20, chunk_budget=8192, max_running=max(rows, 8), eos_ids=frozenset({2}),
                      spec_steps=t - 1)
    core = SchedulerCore(cfg)
    planner = Planner(core)
    dec = msgspec.msgpack.Decoder(StepResult)
    params = SamplingParams(max_new_tokens=1 << 30, ignore_eos=True, temperature=0.0)
    for i in range(rows):
        core.add_request(GenerateReq(f"r{i}", pack_i32(list(range(5, 105))), params, time.time()))
    pending = [_result_for(planner.plan(), t) for _ in range(2)]  # overlap: two steps in flight
    junk = np.ones(evict_mb << 17)  # float64: evict_mb MiB
    out = []
    gc.disable()
    try:
        for i in range(iters + 50):
            if evict_mb:
                junk += 1.0  # the rest of a step runs between two of these: caches are not warm
            raw = pending.pop(0)
            t0 = time.perf_counter()
            core.on_result(dec.decode(raw))
            plan = planner.plan()
            _enc.encode(plan)
            if i >= 50:  # past the prefill steps
                out.append(time.perf_counter() - t0)
            core.take_outputs()
            pending.append(_result_for(plan, t))
    finally:
        gc.enable()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--t", type=int, nargs="+", default=[1, 4], help="tokens per step (S+1 with MTP)")
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--evict-mb", type=int, default=16)
    a = ap.parse_args()
    for rows in a.rows:
        for t in a.t:
            us = [x * 1e6 for x in time_steps(rows, t, a.iters, a.evict_mb)]
            print(json.dumps({"rows": rows, "t": t, "median_us": round(statistics.median(us), 1),
                              "p90_us": round(sorted(us)[int(0.9 * len(us))], 1)}), flush=True)


if __name__ == "__main__":
    main()
