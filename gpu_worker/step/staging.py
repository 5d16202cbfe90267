"""One pinned staging buffer and at most one host-to-device copy per step (none when nothing is
staged: a decode batch whose rows the graph bucket already holds).

A step's host-side metadata (slots, page-table appends, admitted requests' sampling params,
prefill tokens and positions, index arrays) is collected into a ``StageBatch`` by name, packed
into one pinned int64 buffer, copied to the device in one ``non_blocking`` copy, and read back
as device views. 8-byte payloads only: int64 as is, float64 viewed as int64 bits.

Invariants:
- a pinned buffer is rewritten only after the copy that read it has run: the buffers form a
  ring, and each remembers the event recorded right after its copy;
- the device buffer is reused by the next step's copy, which the stream orders after every
  kernel of this step, so views handed out for a step stay valid for all of that step's work.
On the CPU there is no copy: views are the numpy arrays themselves.
"""

from __future__ import annotations

import numpy as np
import torch

DEPTH = 4  # pinned buffers in the ring (up to three steps in flight, --overlap-depth 3, plus one)


class StageBatch:
    def __init__(self, stage: "Staging"):
        self._stage = stage
        self._host: dict[str, np.ndarray] = {}
        self._dev: dict[str, torch.Tensor] = {}
        self.extras: dict = {}  # host-only objects a backend's stage() hands to its build(), same step

    def put(self, name: str, arr) -> None:
        a = np.asarray(arr)
        if a.dtype.kind == "f":
            a = a.astype(np.float64)
        elif a.dtype != np.int64:
            a = a.astype(np.int64)
        self._host[name] = a.reshape(-1)

    def upload(self) -> "StageBatch":
        self._dev = self._stage.upload(self._host)
        return self

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._dev[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self._dev.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._host


class Staging:
    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = device
        self.cuda = device.type == "cuda"
        self._host: list[torch.Tensor] = []
        self._events: list = [None] * DEPTH
        self._next = 0
        self._dev: torch.Tensor | None = None
        if self.cuda:
            self._grow(capacity)

    def batch(self) -> StageBatch:
        return StageBatch(self)

    def _grow(self, n: int) -> None:
        self._host = [torch.empty(n, dtype=torch.int64, pin_memory=True) for _ in range(DEPTH)]
        self._events = [None] * DEPTH  # old buffers stay alive until their copies are done
        self._dev = torch.empty(n, dtype=torch.int64, device=self.device)

    def upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        if not self.cuda:  # (a read-only array, e.g. PlanRows' shared empties, is copied first)
            return {k: _typed(torch.from_numpy(a if a.flags.writeable else a.copy()), a.dtype)
                    for k, a in arrays.items()}
        total = sum(_padded(a.size) for a in arrays.values())
        if total == 0:  # a decode step whose slots the graph buffer holds: nothing to copy
            return {k: _typed(self._dev[:0], a.dtype) for k, a in arrays.items()}
        if total > self._dev.numel():
            torch.cuda.current_stream().synchronize()  # rare: let queued copies finish first
            self._grow(max(total, 2 * self._dev.numel()))
        i = self._next
        self._next = (i + 1) % DEPTH
        if self._events[i] is not None:
            self._events[i].synchronize()  # normally long done: DEPTH steps ago
        host = self._host[i].numpy()
        off, spans = 0, {}
        for k, a in arrays.items():
            host[off : off + a.size] = a.view(np.int64)
            spans[k] = (off, a.size, a.dtype)
            off += _padded(a.size)
        dev = self._dev
        if off:
            dev[:off].copy_(self._host[i][:off], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[i] = ev
        return {k: _typed(dev[o : o + n], dt) for k, (o, n, dt) in spans.items()}


def _padded(n: int) -> int:
    """Each array starts 16-byte aligned (2 int64s): kernels see the same pointer alignment
    every step (Triton specialises on it)."""
    return n + (n & 1)


def _typed(t: torch.Tensor, dtype: np.dtype) -> torch.Tensor:
    return t.view(torch.float64) if dtype.kind == "f" else t
