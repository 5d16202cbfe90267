"""A launched step's outputs on their way home (``Pending``), and the copies that bring them.

``CopyHome.copy`` queues device-to-host copies of a step's outputs and returns the host tensors
with the event after which they have landed; ``Pending.result`` waits for that event and builds
the ``StepResult``. Step N+1 is launched before step N's event fires (overlap): it reads N's
outputs from slot state, ordered by the stream, never from these host copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from gpu_worker.step.timer import StepTimer
from proto.messages import Logprobs, SlotError, StepResult


@dataclass
class Pending:
    step_id: int
    slots: np.ndarray  # result rows' slots
    tokens: torch.Tensor  # host [R, T] int32
    accept: torch.Tensor  # host [R] int32
    logprobs: tuple | None  # host (chosen, top ids, top values), or None
    prompt_lps: list
    event: object  # when the host tensors have landed (None: already)
    timer: StepTimer
    errors: list[SlotError] = field(default_factory=list)
    on_tokens: Callable | None = None  # GrammarRows.observe, for steps with constrained rows
    compiled: list = field(default_factory=list)  # GrammarDone: grammars compiled ahead of admission

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def result(self) -> StepResult:
        if self.event is not None:
            self.event.synchronize()
        lp = None
        if self.logprobs is not None:
            chosen, ids, vals = (x.numpy() if x is not None else None for x in self.logprobs)
            top = 0 if ids is None else ids.shape[-1]
            lp = Logprobs(chosen.tobytes(), b"" if ids is None else ids.tobytes(),
                          b"" if vals is None else vals.tobytes(), top)
        fwd, drf, busy, gap = self.timer.elapsed()
        if self.on_tokens is not None:  # called once per step, in step order (the worker loop)
            self.on_tokens(self.slots, self.tokens.numpy(), self.accept.numpy())
        return StepResult(self.step_id, self.slots.astype(np.int32).tobytes(), self.tokens.numpy().tobytes(),
                          self.accept.numpy().tobytes(), lp, self.prompt_lps, fwd, drf, busy, gap, self.errors,
                          self.compiled)


class CopyHome:
    """Device-to-host copies of step outputs, on a side stream on CUDA.

    The copies run on their own stream, so the next step's kernels need not queue behind a
    device-to-host copy. Invariants: a source is read there only after every kernel queued
    before it on the compute stream; a temporary is not reused before its copy
    (``record_stream``); a graph bucket's ``result`` buffer is rewritten only after the last
    copy (the runner waits for ``last`` before a greedy-tail replay). On the CPU a clone: an
    output may be a graph bucket's buffer, which the next step overwrites before this one is
    read."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last = None  # the event of the last copy

    def copy(self, xs: list, timer: StepTimer) -> tuple[list, object]:
        """Host copies of ``xs`` (None stays None) and the event after which they have landed
        (None on the CPU); marks the timer's end first."""
        timer.mark()
        if self.stream is None:
            return [None if x is None else x.clone() for x in xs], None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        hosts = []
        with torch.cuda.stream(self.stream):
            for x in xs:
                host = None  # (a logprobs part that was not asked for)
                if x is not None:
                    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                    host.copy_(x, non_blocking=True)
                    x.record_stream(self.stream)
                hosts.append(host)
            self.last = torch.cuda.Event()
            self.last.record(self.stream)
        return hosts, self.last

    def before_rewrite(self) -> None:
        """The compute stream waits for the last copy (before it rewrites a buffer that copy reads)."""
        if self.last is not None:
            torch.cuda.current_stream(self.device).wait_event(self.last)
