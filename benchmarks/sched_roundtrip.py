"""The scheduler's share of a host-bound step, timed without a device.

Small models are host-bound on a GPU: at depth 2, between result N leaving the worker and plan
N+2 reaching it sit two socket hops and the scheduler's work (a large share of the bundled
pair's step cycle). This runs the real scheduler process
against a stand-in worker that answers every plan at once (each decode row accepts all T tokens)
and a stand-in front that drains the outputs, so the steady step period is the scheduler's loop
plus its sockets: the floor a GPU step would have to beat for the scheduler to stay hidden.

    python benchmarks/sched_roundtrip.py [--rows 1 8 64] [--steps 3000] [--t 1] [--depth 2]

Prints one JSON line per row count: steps per second and microseconds a step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from common.args import ServerArgs  # noqa: E402
from proto.arrays import pack_i32, view_i32  # noqa: E402
from proto.messages import (GenerateReq, SamplingParams, Shutdown, StepOutputs, StepPlan,  # noqa: E402
                            StepResult, WorkerReady)
from proto.transport import PullChannel, PushChannel, ipc_endpoints  # noqa: E402


def stand_in_worker(ep, t: int, slots: int) -> None:
    """Answer each plan at once: its sampled rows (prefill ends, decode rows) get T tokens."""
    ctx = zmq.Context()
    plans = PullChannel(ctx, "plans", ep.plans)
    results = PushChannel(ctx, "results", ep.results)
    results.send(WorkerReady(page_size=16, num_pages=200_000, max_slots=slots, vocab_size=32000,
                             max_context=1 << 20, dtype="bfloat16", device="cuda", architecture="stand-in",
                             tokens_per_step=t, speculative_num_steps=t - 1))
    tokens: dict[int, bytes] = {}
    while True:
        plan = plans.recv()
        if isinstance(plan, Shutdown):
            break
        assert isinstance(plan, StepPlan)
        rows = [e.slot for e in plan.extend if e.sample] + view_i32(plan.decode_slots).tolist()
        n = len(rows)
        if n not in tokens:
            tokens[n] = pack_i32(np.full(n * t, 7))
        results.send(StepResult(step_id=plan.step_id, slots=pack_i32(rows), tokens=tokens[n],
                                accept_lens=pack_i32(np.full(n, t)), busy_s=1e-4))
    ctx.destroy(linger=0)


def profiled_scheduler(args, ep, out: str) -> None:
    """The scheduler process under cProfile (``--profile``): stats by own time into ``out``."""
    import cProfile
    import pstats

    from scheduler_proc.main import run as run_scheduler

    prof = cProfile.Profile()
    try:
        prof.runcall(run_scheduler, args, ep)
    finally:
        with open(out, "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)


def measure(rows: int, steps: int, t: int, depth: int, profile: str | None = None) -> dict:
    from scheduler_proc.main import run as run_scheduler

    ep = ipc_endpoints(tempfile.mkdtemp(prefix="tandem-rt-"))
    ctx = zmq.Context()
    outputs = PullChannel(ctx, "outputs", ep.outputs)
    spawn = mp.get_context("spawn")
    args = ServerArgs(model_path="stand-in", overlap_depth=depth, log_level="warning")
    sched = (spawn.Process(target=run_scheduler, args=(args, ep), daemon=True) if profile is None else
             spawn.Process(target=profiled_scheduler, args=(args, ep, f"{profile}.{rows}.txt"), daemon=True))
    worker = spawn.Process(target=stand_in_worker, args=(ep, t, max(rows, 8)), daemon=True)
    sched.start()
    worker.start()
    requests = PushChannel(ctx, "requests", ep.requests)
    params = SamplingParams(max_new_tokens=1 << 30, ignore_eos=True, temperature=0.0)
    for i in range(rows):
        requests.send(GenerateReq(f"r{i}", pack_i32(np.arange(5, 105)), params, time.time()))
    seen, marks = 0, {}
    warm = 200
    while seen < warm + steps:
        msg = outputs.recv(timeout_ms=30_000)
        if msg is None:
            raise RuntimeError("no output for 30 s")
        if isinstance(msg, StepOutputs):
            # one output per row per step in the steady state: count steps by request r0
            seen += sum(1 for o in msg.outputs if o.rid == "r0")
            if seen >= warm and "t0" not in marks:
                marks["t0"], marks["s0"] = time.perf_counter(), seen
    dt = time.perf_counter() - marks["t0"]
    n = seen - marks["s0"]
    requests.send(Shutdown("done"))
    sched.join(10)
    worker.join(10)
    for p in (sched, worker):
        if p.is_alive():
            p.kill()
    ctx.destroy(linger=0)
    return {"rows": rows, "t": t, "depth": depth, "steps": n, "steps_per_s": round(n / dt, 1),
            "us_per_step": round(dt / n * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--t", type=int, default=1, help="tokens per step (S+1 with MTP)")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--profile", help="cProfile the scheduler into PROFILE.<rows>.txt")
    a = ap.parse_args()
    for rows in a.rows:
        print(json.dumps(measure(rows, a.steps, a.t, a.depth, a.profile)), flush=True)


if __name__ == "__main__":
    main()
