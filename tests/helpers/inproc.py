"""The scheduler and the worker's runner in one process, no sockets: fast engine tests.

Plans and results go through msgspec encode/decode anyway, so the wire format is exercised.
``depth`` 2 launches plan N+1 before result N is consumed, like the overlap loop (3: N+2 too).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

import msgspec
import numpy as np

from gpu_worker.main import build_runner
from gpu_worker.settings import DevSettings
from proto.arrays import pack_i32, view_i32
from proto.args import ServerArgs
from proto.messages import GenerateReq, PlanMsg, ResultMsg, SamplingParams
from scheduler_proc.core import SchedConfig, SchedulerCore
from scheduler_proc.planner import Planner

_enc = msgspec.msgpack.Encoder()
_dec_plan = msgspec.msgpack.Decoder(PlanMsg)
_dec_result = msgspec.msgpack.Decoder(ResultMsg)


class InProcEngine:
    """``compiled``: on the CPU, decode steps run the compiled programs (``graphs/cpu_steps.py``;
    the first engine of a model shape builds them, a minute or two), as ``tandem serve`` does by
    default; otherwise they run eagerly, unless the test asks for the emulated CUDA-graph path."""

    def __init__(self, model_path: str, draft: str | None = None, steps: int = 3, overlap: bool = True,
                 depth: int = ServerArgs.overlap_depth, compiled: bool = False, **kw):
        spec = dict(speculative_algorithm="FROZEN-KV-MTP", speculative_draft_model_path=draft,
                    speculative_num_steps=steps) if draft else {}
        if kw.get("device", "cpu") == "cpu" and not compiled and not DevSettings.from_env().emulate_cuda_graphs:
            kw.setdefault("disable_cuda_graph", True)
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


def top_alternatives(eng: InProcEngine, rid: str) -> list[dict[int, float]]:
    """Per generated token of ``rid`` (submitted with ``logprobs=k``): {token id: logprob} of its
    top-k alternatives — where two engines' tokens part, both choices should be a near-tie."""
    rows = []
    for out in eng.outputs[rid]:
        lp = out.logprobs
        if lp is None or not lp.top:
            continue
        ids = np.frombuffer(lp.top_ids, np.int32).reshape(-1, lp.top)
        vals = np.frombuffer(lp.top_logprobs, np.float32).reshape(-1, lp.top)
        rows += [dict(zip(i.tolist(), v.tolist())) for i, v in zip(ids, vals)]
    return rows
