"""Step timing on the device: CUDA events (read once the step's copy is done) on the GPU, the
wall clock on the CPU (``ModelRunner`` marks each step; ``StepResult`` carries the figures)."""

from __future__ import annotations

import time

import torch


class StepTimer:
    """Step timing: CUDA events on GPU (read after the step's copy event), wall clock on CPU.

    Marks: start, after the draft, after the target forward + sampling, end (after the copy
    out). busy = start -> end; gap = the previous step's end -> this start, i.e. device idle
    between steps when this step was queued only after the previous one finished.
    """

    def __init__(self, device: torch.device, prev: "StepTimer | None"):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.prev_end = prev.marks[-1] if prev is not None and len(prev.marks) == 4 else None

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def _dt(self, a, b) -> float:
        return max(0.0, a.elapsed_time(b) / 1e3) if self.cuda else b - a

    def elapsed(self) -> tuple[float, float, float, float]:
        """(forward_s, draft_s, busy_s, gap_s)."""
        if len(self.marks) < 4:
            return 0.0, 0.0, 0.0, 0.0
        a, b, c, d = self.marks[:4]
        gap = self._dt(self.prev_end, a) if self.prev_end is not None else 0.0
        return self._dt(b, c), self._dt(a, b), self._dt(a, d), gap
