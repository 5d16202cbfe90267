"""One ``generate`` / ``chat`` call's requests through the engine: submitted a window at a time,
their outputs folded in by the front's own ``RequestState`` (detokenizer, stop strings), the
results returned in the input order.

The window keeps ``WINDOW_PER_SLOT`` x the engine's running slots submitted: enough that the
scheduler always has a queue to fill a freed slot from, and never near ``--max-queued-requests``
(the scheduler refuses past it). A request the engine ends with an error (a grammar that does
not compile) fails the call: the rest are aborted, as is everything on Ctrl-C.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from proto.arrays import pack_i32
from proto.messages import AbortReq, GenerateReq, ReqOutput, StepOutputs
from tandem.llm_engine import EngineLink
from tokenizer_proc.request_state import RequestState
from tokenizer_proc.streaming import ChoiceResult

WINDOW_PER_SLOT = 2
ABORT_DRAIN_S = 5.0  # how long aborted requests get to send their final outputs


@dataclass
class PlannedRequest:
    """One prompt's engine requests (``n`` choices) and what its output reports."""

    request_id: str
    prompt: str | None
    states: list[RequestState]
    want_logprobs: bool
    results: list[ChoiceResult] | None = None
    finished_time: float = 0.0

    @property
    def done(self) -> bool:
        return self.results is not None and all(r.finish_reason is not None for r in self.results)


class BatchRun:
    def __init__(self, engine: EngineLink, requests: list[PlannedRequest], on_done: Callable[[PlannedRequest], None]):
        self.engine = engine
        self.requests = requests
        self.on_done = on_done
        self.waiting = deque(requests)
        self.results: dict[str, tuple[PlannedRequest, ChoiceResult]] = {}  # in flight, by engine rid
        self.window = max(1, WINDOW_PER_SLOT * engine.info.max_running_requests)

    def run(self) -> None:
        try:
            while self.waiting or self.results:
                self._submit()
                msg = self.engine.recv(timeout_ms=500)
                if isinstance(msg, StepOutputs):
                    for out in msg.outputs:
                        self._on_output(out)
        except BaseException:
            self._abort_all()
            raise

    def _submit(self) -> None:
        while self.waiting and len(self.results) < self.window:
            req = self.waiting.popleft()
            req.results = [ChoiceResult(s) for s in req.states]
            for state, result in zip(req.states, req.results):
                self.results[state.rid] = (req, result)
                state.arrival_mono, state.arrival_wall = time.monotonic(), time.time()
                self.engine.send(GenerateReq(state.rid, pack_i32(state.prompt_ids), state.params, state.arrival_wall))

    def _on_output(self, out: ReqOutput) -> None:
        entry = self.results.get(out.rid)
        if entry is None:  # the echo of a request ended here already (a stop string)
            return
        req, result = entry
        state = result.state
        delta = state.apply(out)
        if delta is None:
            return
        if delta.token_ids:
            now = time.monotonic()
            state.first_token_mono = state.first_token_mono or now
            state.last_token_mono = now
        result.add(delta)
        if not delta.finished:
            return
        del self.results[out.rid]
        if out.finish_reason is None:  # a stop string ended it here: the engine still runs it
            self.engine.send(AbortReq(out.rid, "stop_string"))
        if delta.error is not None:
            raise (ValueError if delta.error_code == 400 else RuntimeError)(
                f"request {req.request_id}: {delta.error}")
        if req.done:
            req.finished_time = time.time()
            self.on_done(req)

    def _abort_all(self) -> None:
        """Abort what is in flight and wait (bounded) for the engine to let go of it, so the
        next call starts on an idle engine. Nothing to wait for once the engine is dead."""
        pending = set(self.results)
        self.results.clear()
        self.waiting.clear()
        if self.engine.closed:
            return
        try:
            for rid in pending:
                self.engine.send(AbortReq(rid, "client_disconnect"))
            deadline = time.monotonic() + ABORT_DRAIN_S
            while pending and time.monotonic() < deadline:
                msg = self.engine.recv(timeout_ms=100)
                if isinstance(msg, StepOutputs):
                    pending -= {o.rid for o in msg.outputs if o.finish_reason is not None}
        except Exception:  # noqa: BLE001 - the engine died meanwhile: the original error is the one to raise
            pass
