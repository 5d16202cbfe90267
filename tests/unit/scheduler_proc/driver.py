"""The scheduler tests' harness: a scheduler core and planner over the simulated worker
(``tests/unit/sim_worker.py``), driven with 1-3 steps in flight as the real worker runs them."""

from __future__ import annotations

import time
from collections import defaultdict, deque

from proto.arrays import pack_i32, view_i32
from proto.messages import GenerateReq, SamplingParams
from scheduler_proc.core import SchedConfig, SchedulerCore
from scheduler_proc.planner import Planner
from tests.unit.sim_worker import EOS, SimWorker

def make(t=1, num_pages=64, ps=4, slots=8, chunk=16, cache=True, max_context=256, mixed=True):
    cfg = SchedConfig(page_size=ps, num_pages=num_pages, max_slots=slots, tokens_per_step=t,
                      max_context=max_context, chunk_budget=chunk, max_running=slots,
                      eos_ids=frozenset({EOS}), spec_steps=t - 1, enable_prefix_cache=cache,
                      mixed_prefill=mixed)
    core = SchedulerCore(cfg)
    return core, Planner(core), SimWorker(num_pages, ps, slots, t, seed=1)


class Driver:
    """Runs scheduler + simulated worker with overlap depth 1 or 2."""

    def __init__(self, core, planner, worker, depth):
        self.core, self.planner, self.worker, self.depth = core, planner, worker, depth
        self.pending = deque()
        self.tokens = defaultdict(list)
        self.finish = {}

    def step(self) -> None:
        while len(self.core.inflight) < self.depth and (plan := self.planner.plan()) is not None:
            self.pending.append(self.worker.run(plan))
        if self.pending:
            self.core.on_result(self.pending.popleft())
        for out in self.core.take_outputs():
            assert out.rid not in self.finish, f"output after finish for {out.rid}"
            self.tokens[out.rid].extend(view_i32(out.token_ids).tolist())
            if out.finish_reason:
                self.finish[out.rid] = out.finish_reason

    def run_until_idle(self, limit=10000) -> None:
        for _ in range(limit):
            if self.core.idle():
                return
            self.step()
        raise AssertionError("scheduler did not drain")


def submit(core, rid, prompt, max_new=20, ignore_eos=False, min_new=0):
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=ignore_eos, min_new_tokens=min_new)
    core.add_request(GenerateReq(rid, pack_i32(prompt), params, time.time()))
