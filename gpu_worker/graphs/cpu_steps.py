"""Decode steps on the CPU through compiled programs: the CPU twin of ``DecodeGraphs``.

On the CPU a decode step's time is per-op dispatch, not arithmetic: the bundled pair's ~10M
parameters take about a dozen milliseconds a step eagerly, most of it hundreds of small torch
calls. Here the step's device work (``DecodeBody``'s draft, target and greedy tail) runs as
three programs compiled ahead of time by AOTInductor (``cpu_programs.py``, built and cached by
``cpu_build.py``): fused loops in C++ around the GEMMs, no Python between them.

Same interface as ``DecodeGraphs`` (``bucket``, ``holds``, ``slots``, ``run``, ``run_tail``), so
the runner's graph path serves both. The programs' batch size is symbolic, so the target and the
tail run every batch up to the largest at its exact size (no padding rows); buffers are kept per
size. Each call passes the key bound ``K`` (every row's KV length after the step, rounded up to a
page), the one size that moves from step to step.

The target's and the draft's linears up to 8 (float32) or 4 (bfloat16) rows run the programs' own
GEMM (``cpu_ops.py``: a library built with the programs, loaded before them); where the models
take the AMX layout (``models/cpu_layout.py``: bfloat16 weights, a CPU with AMX-BF16) every
linear does, at any row count. Otherwise the draft (bfloat16 under a float32 target where the
CPU has bfloat16 instructions, ``gpu_worker/main.py: draft_dtype``) past 4 rows runs its GEMMs
through oneDNN, which keeps kernels and buffers per row count, ~4 MB each for the bundled pair's
draft: so from two rows it runs at a power of two, the rows past the batch padding (slot 0, whose
drafts nobody reads), and holds 2 row counts up to 16 rather than 12. oneDNN stays off at one
row (the draft's other ops then take torch's own paths). A float32 draft pads alike: its few-row
GEMM streams the weights once whatever the row count, so the padding rows cost little.

Invariants: a size's ``tokens`` / ``result`` buffers are rewritten by its next step; the CPU
runs a step to completion in ``run`` / ``run_tail``, and the runner clones the result before
the next step (``CopyHome``). The programs read the models' weights in place (bound at load,
``user_managed``): nothing may replace a parameter or buffer tensor after ``load``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from gpu_worker.graphs.cpu_ops import load_library
from gpu_worker.graphs.cpu_programs import PROGRAMS, step_inputs

log = logging.getLogger("tandem.worker")


class Program:
    """One compiled program, its constants bound to the models' own tensors."""

    def __init__(self, path: str, constants: dict[str, torch.Tensor]):
        self.loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
        names = self.loader.get_constant_fqns()
        missing = [n for n in names if n not in constants]
        if missing:
            raise ValueError(f"{path}: constants the models lack: {missing[:3]}")
        # (use the active buffer, check every constant is given, user-managed: no copy)
        self.loader.load_constants({n: constants[n] for n in names}, False, True, True)

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.loader.boxed_run(list(inputs))  # boxed_run takes the list's references


def model_constants(target, assistant) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under the names the programs use (``target.*``, ``assistant.*``)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, model in (("target", target), ("assistant", assistant)):
        if model is None:
            continue
        out.update(model.named_parameters(prefix=prefix, remove_duplicate=False))
        out.update(model.named_buffers(prefix=prefix, remove_duplicate=False))
    return {k: v.detach() for k, v in out.items()}


def draft_rows(n: int) -> int:
    """The rows the draft program runs for a batch of ``n``: 1, else the next power of two."""
    return 1 << (n - 1).bit_length()


@contextlib.contextmanager
def _onednn(enabled: bool) -> Iterator[None]:
    """oneDNN on or off for the ops run inside (a process-wide flag that aten's GEMMs read)."""
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(enabled)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(before)


@dataclass
class _Size:
    slots: torch.Tensor  # [n]
    tokens: torch.Tensor  # [n, T]
    result: torch.Tensor  # [n, T + 1] int32


@dataclass
class _DraftRows:
    """A padded batch of the draft: slots [rows] (slot 0 past the batch), tokens [rows, T]."""

    slots: torch.Tensor
    tokens: torch.Tensor


class CpuDecodeSteps:
    def __init__(self, programs: dict[str, Program], state, pool, t: int, max_batch: int):
        self.programs, self.state, self.pool, self.t = programs, state, pool, t
        self.sizes = list(range(1, max_batch + 1))
        self.max_batch = max_batch
        self._page = pool.page_size
        self._max_keys = state.page_table.shape[1] * pool.page_size
        self._cols = torch.arange(self._max_keys, dtype=torch.int64)
        self._seq = state.seq_len.numpy()  # the device state itself: the CPU reads it for free
        self._held: dict[int, np.ndarray] = {}
        self._per_size: dict[int, _Size] = {}
        self._draft_pad: dict[int, _DraftRows] = {}  # by draft_rows(n), apart from _per_size's buffers
        self._tail_inputs: list[torch.Tensor] = []  # the last step's inputs and (hidden, logits)

    @classmethod
    def load(cls, paths: dict[str, str], target, assistant, state, pool, t: int, max_batch: int) -> "CpuDecodeSteps":
        t0 = time.perf_counter()
        load_library(os.path.dirname(next(iter(paths.values()))))  # before the packages that link it
        constants = model_constants(target, assistant)
        programs = {name: Program(path, constants) for name, path in paths.items()}
        steps = cls(programs, state, pool, t, max_batch)
        log.info("compiled CPU steps: %s loaded in %.2f s (batch 1-%d, any context)",
                 "/".join(n for n in PROGRAMS if n in programs), time.perf_counter() - t0, max_batch)
        return steps

    def bucket(self, n: int) -> int | None:
        return n if 0 < n <= self.max_batch else None

    def _size(self, n: int) -> _Size:
        s = self._per_size.get(n)
        if s is None:
            s = self._per_size[n] = _Size(torch.zeros(n, dtype=torch.int64), torch.zeros(n, self.t, dtype=torch.int64),
                                          torch.zeros(n, self.t + 1, dtype=torch.int32))
            self._held[n] = np.zeros(n, dtype=np.int64)
        return s

    def holds(self, bucket: int, padded: np.ndarray) -> bool:
        self._size(bucket)
        return np.array_equal(self._held[bucket], padded)

    def slots(self, n: int) -> torch.Tensor:
        return self._size(n).slots

    def _inputs(self, s: _Size, padded: np.ndarray) -> list[torch.Tensor]:
        """The programs' leading inputs for this step: keys up to every row's length after it."""
        keys = int(self._seq[padded].max()) + self.t
        keys = min(-(-keys // self._page) * self._page, self._max_keys)
        return step_inputs(s.slots, s.tokens, self._cols[:keys], self.state, self.pool)

    def run(self, n: int, padded: np.ndarray, padded_dev: torch.Tensor | None, mark):
        """``DecodeGraphs.run``: the draft (with MTP), ``mark()``, the target -> (tokens [n, T],
        hidden [n*T, H], logits [n*T, V])."""
        s = self._size(n)
        if padded_dev is not None:
            s.slots.copy_(padded_dev)
            self._held[n] = padded
        inputs = self._inputs(s, padded)
        if "draft" in self.programs:
            self._draft(n, s, inputs)
        mark()
        hidden, logits = self.programs["target"](inputs)
        self._tail_inputs = [*inputs, hidden, logits]
        return s.tokens, hidden, logits

    def _draft(self, n: int, s: _Size, inputs: list[torch.Tensor]) -> None:
        """The bonus and drafts into ``s.tokens``, at ``draft_rows(n)`` rows (module docstring)."""
        rows = draft_rows(n)
        if rows == n:
            with _onednn(n > 1):
                self.programs["draft"](inputs)
            return
        pad = self._draft_pad.get(rows)
        if pad is None:
            pad = self._draft_pad[rows] = _DraftRows(torch.zeros(rows, dtype=torch.int64),
                                                     torch.zeros(rows, self.t, dtype=torch.int64))
        pad.slots[:n].copy_(s.slots)
        pad.slots[n:].zero_()
        self.programs["draft"]([pad.slots, pad.tokens, *inputs[2:]])
        s.tokens.copy_(pad.tokens[:n])

    def run_tail(self, n: int) -> torch.Tensor:
        """After ``run(n, ...)`` of an all-greedy step: tokens, accept counts and the slot-state
        update -> result [n, T + 1]."""
        s = self._size(n)
        self.programs["tail"]([*self._tail_inputs, s.result])
        return s.result
