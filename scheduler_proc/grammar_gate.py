"""Requests whose grammar compiles before they may be admitted.

A structured-output request does not join the waiting queue at arrival: its grammar goes to the
worker in the next plan (``StepPlan.compile``), the worker compiles it on a side thread, and the
request joins the queue once a result says it compiled (``StepResult.compiled``), or ends with
the compile's error (HTTP 400) without ever taking a slot. So no step waits on a compile: one
deeply nested schema can take the compiler seconds, and every row of a step would wait for it
(vLLM and SGLang hold such requests the same way). With nothing else to run, the scheduler
sends plans that carry no rows to ask (``due``): the worker answers each within ~10 ms.

Invariants: a held request is in neither ``waiting`` nor ``running`` and holds no slot or page;
its key is answered exactly once (an abort drops the key: the answer is then ignored).
"""

from __future__ import annotations

import itertools

from proto.messages import GrammarCompile, GrammarDone
from scheduler_proc.request import Req


class GrammarGate:
    def __init__(self) -> None:
        self.held: dict[int, Req] = {}  # key -> request, until its GrammarDone returns
        self.to_send: list[GrammarCompile] = []  # for the next plan
        self._keys = itertools.count(1)

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, req: Req) -> None:
        key = next(self._keys)
        self.held[key] = req
        self.to_send.append(GrammarCompile(key, req.params.grammar))

    def take(self) -> list[GrammarCompile]:
        out, self.to_send = self.to_send, []
        return out

    def drop(self, req: Req) -> bool:
        """An aborted request, if held: its answer, when it comes, finds no key and is ignored."""
        keys = [k for k, r in self.held.items() if r is req]
        for key in keys:
            del self.held[key]
        return bool(keys)

    def due(self, steps_in_flight: bool) -> bool:
        """Whether a plan with no rows is worth sending: grammars to hand over, or (nothing in
        flight to bring the answer) compiles to ask after."""
        return bool(self.to_send) or (bool(self.held) and not steps_in_flight)

    def answered(self, done: list[GrammarDone]) -> list[tuple[Req, str]]:
        """(request, error: "" when compiled) for each answer of a request still live."""
        out = []
        for d in done:
            req = self.held.pop(d.key, None)
            if req is not None and not req.finished:
                out.append((req, d.error))
        return out
