"""The scheduler core and the worker's runner in one process, no sockets: a developer tool.

``InProcEngine`` drives ``SchedulerCore`` + ``Planner`` and ``ModelRunner`` as the two processes
do, in one loop: engine tests run it without process start-up, and profilers see the host's
scheduling and the device work in one process (``benchmarks/profile_step.py``: torch.profiler and
cProfile; ``benchmarks/grammar_stall_bench.py``: per-step timing). Plans and results still go
through msgspec encode/decode, so the wire format is exercised. ``depth`` 2 launches plan N+1
before result N is consumed, like the overlap loop (3: N+2 too). Users run ``tandem.LLM`` (the
real processes); this is not an API.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

import msgspec

from common.args import ServerArgs
from gpu_worker.main import build_runner
from proto.arrays import pack_i32, view_i32
from proto.messages import GenerateReq, PlanMsg, ResultMsg, SamplingParams
from scheduler_proc.core import SchedConfig, SchedulerCore
from scheduler_proc.planner import Planner

_enc = msgspec.msgpack.Encoder()
_dec_plan = msgspec.msgpack.Decoder(PlanMsg)
_dec_result = msgspec.msgpack.Decoder(ResultMsg)


class InProcEngine:
    """``submit`` token-id prompts (proto ``SamplingParams`` fields as keywords, greedy unless
    told), ``run`` until idle; ``tokens``, ``outputs`` and ``finish`` hold the results by request
    id. Keywords besides these are ``ServerArgs`` fields (device: cpu unless told)."""

    def __init__(self, model_path: str, draft: str | None = None, steps: int = 3, overlap: bool = True,
                 depth: int = ServerArgs.overlap_depth, **kw):
        spec = dict(speculative_algorithm="FROZEN-KV-MTP", speculative_draft_model_path=draft,
                    speculative_num_steps=steps) if draft else {}
        self.args = ServerArgs(model_path=model_path, device=kw.pop("device", "cpu"),
                               disable_overlap_schedule=not overlap, overlap_depth=depth, **spec, **kw)
        self.runner, self.ready = build_runner(self.args)
        self.core = SchedulerCore(SchedConfig.from_ready(self.ready, self.args))
        self.planner = Planner(self.core)
        self.depth = self.args.step_depth
        self.tokens = defaultdict(list)
        self.outputs = defaultdict(list)
        self.finish: dict[str, str] = {}
        self.pending = deque()  # launched steps whose result is not processed (kept across run calls)

    def submit(self, rid: str, prompt: list[int], **params) -> None:
        params.setdefault("temperature", 0.0)
        self.core.add_request(GenerateReq(rid, pack_i32(prompt), SamplingParams(**params), time.time()))

    def run(self, limit: int = 100000, until=None) -> None:
        """Step until idle, or until ``until()`` is true after a processed result (steps still
        in flight then stay in flight: the next call goes on from there)."""
        pending = self.pending
        for _ in range(limit):
            while len(self.core.inflight) < self.depth and (plan := self.planner.plan()) is not None:
                pending.append(self.runner.launch(_dec_plan.decode(_enc.encode(plan)), retire=self._retire_all))
            if pending:
                self._process_oldest()
                if until is not None and until():
                    self._take()
                    return
            self._take()
            if self.core.idle():
                return
        raise AssertionError("engine did not drain")

    def _retire_all(self) -> None:
        """Every launched step's result, oldest first (a constrained step's ``retire``)."""
        while self.pending:
            self._process_oldest()

    def _process_oldest(self) -> None:
        self.core.on_result(_dec_result.decode(_enc.encode(self.pending.popleft().result())))

    def _take(self) -> None:
        for out in self.core.take_outputs():
            self.outputs[out.rid].append(out)
            self.tokens[out.rid].extend(view_i32(out.token_ids).tolist())
            if out.finish_reason:
                self.finish[out.rid] = out.finish_reason

