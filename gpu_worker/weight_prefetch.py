"""L2 warm-up of the next projection's weights inside captured decode graphs.

A decode step at 1-4 rows streams every weight once; between two projections, norms, RoPE +
KV store, attention and the activation run for ~19 us a Llama-8B layer with HBM nearly idle.
Here each projection, once launched, forks a side stream that reads the *next* projection's
weights into L2 (``kernels/l2_warm.py``) while those small kernels run; the next projection then
reads that part at L2 speed. Values never change: the side stream only reads weights.

- ``link(model)``: at load, each ``Linear`` learns the weight of the ``Linear`` registered after
  it (registration order is execution order in our model files; a wrong guess only costs a
  useless read). TP > 1 is not linked.
- ``armed(device)``: around the warm-up and capture of a decode graph. Outside it, nothing forks,
  so eager steps, prefill and the CPU are untouched.
- ``after_projection(next_w, rows)``: the hook ``Linear.forward`` calls.

Invariants: the side stream waits for the projection that forks it (so the read overlaps what
runs after it, not the projection itself); warm-ups queue on the one side stream, so two never
run at once and their scratch word buffer is never written concurrently; ``armed`` joins the
side stream back before it returns, so a captured graph ends only after its last warm-up.

``TANDEM_L2_PREFETCH_MB`` = "A,B": MB read ahead for an ``o_proj`` / for the other projections
(``budgets``; default 0 = off). ``TANDEM_L2_PREFETCH_EVICT=last``: L2 prefetches marked
evict-last instead of plain L2 loads.
"""

from __future__ import annotations

import contextlib
import os

import torch

from gpu_worker.kernels.l2_warm import warm_l2

MAX_ROWS = 4  # decode of 1-4 rows and MTP verify of one row: weight-bound steps
PROGRAMS = 264  # warm-up programs (2 per H200 SM): enough reads in flight to reach HBM speed


def budgets() -> tuple[int, int]:
    """(bytes read ahead for an ``o_proj``, for every other projection) from
    ``TANDEM_L2_PREFETCH_MB`` = "A,B" (or "N" for both). The window before ``o_proj`` spans RoPE +
    KV store + attention (~9 us at 8B, one row); before the others only a norm or the
    activation (~2-4 us): a read longer than its window competes with the projection itself,
    and what it brought in is evicted by that projection's own stream before use (32 MB on
    every link made Llama-8B's step 8 % slower, H200 2026-12-03)."""
    raw = os.environ.get("TANDEM_L2_PREFETCH_MB", "0")
    parts = raw.split(",")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"TANDEM_L2_PREFETCH_MB: expected 'N' or 'A,B' (non-negative MB), got {raw!r}")
    a, b = (int(parts[0]), int(parts[-1]))
    return a << 20, b << 20


def evict_last() -> bool:
    value = os.environ.get("TANDEM_L2_PREFETCH_EVICT", "normal")
    if value not in ("last", "normal"):
        raise ValueError(f"TANDEM_L2_PREFETCH_EVICT: expected 'last' or 'normal', got {value!r}")
    return value == "last"


class _Armed:
    """One armed region: the side stream, the scratch words, whether a warm-up is pending."""

    def __init__(self, device: torch.device, budgets: tuple[int, int]):
        self.budgets = budgets
        self.evict_last = evict_last()
        self.side = torch.cuda.Stream(device)
        self.scratch = torch.empty(PROGRAMS, dtype=torch.int32, device=device)
        self.pending = False
        self.launched = 0

    def fork(self, w: torch.Tensor, into_o_proj: bool) -> None:
        budget = self.budgets[0 if into_o_proj else 1]
        if not budget:
            return
        self.side.wait_stream(torch.cuda.current_stream(w.device))
        with torch.cuda.stream(self.side):
            if warm_l2(w, budget, self.scratch, evict_last=self.evict_last):
                self.pending = True
                self.launched += 1
                _LAUNCHED[0] += 1

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream(self.scratch.device).wait_stream(self.side)
            self.pending = False


_ARMED: list[_Armed | None] = [None]
_LAUNCHED = [0]  # warm-ups launched by this process (tests)


def launched_total() -> int:
    return _LAUNCHED[0]


def link(model: torch.nn.Module) -> int:
    """Point each ``Linear`` of ``model`` at the next one's weight; returns the links made."""
    from gpu_worker.models.layers import Linear
    from gpu_worker.parallel.state import tp_size

    if tp_size() != 1:
        return 0
    lins = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    for (_, a), (name_b, b) in zip(lins, lins[1:]):
        a.prefetch_next = b.weight.detach()
        a.prefetch_into_o_proj = name_b.rpartition(".")[2] == "o_proj"
    return max(0, len(lins) - 1)


@contextlib.contextmanager
def armed(device: torch.device):
    """Warm-ups fork inside this block (CUDA, Triton, budget > 0); joined on exit. Yields the
    region (``launched`` counts warm-ups) or None where it does nothing."""
    from gpu_worker.kernels import triton_available

    budget = budgets()
    if device.type != "cuda" or not any(budget) or not triton_available() or _ARMED[0] is not None:
        yield None
        return
    region = _ARMED[0] = _Armed(device, budget)
    try:
        yield region
    finally:
        _ARMED[0] = None
        region.join()


def after_projection(next_w: torch.Tensor, rows: int, into_o_proj: bool) -> None:
    """Called by ``Linear.forward`` after launching its projection."""
    region = _ARMED[0]
    if region is not None and rows <= MAX_ROWS and next_w.is_cuda:
        region.fork(next_w, into_o_proj)
