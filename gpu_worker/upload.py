"""A step's host-built inputs, in typed dataclasses, sent to the device in one copy.

A step's host-side data (slots, page-table appends, admitted requests' sampling params, prefill
tokens and positions, index arrays) is built as numpy arrays in the fields of the path's typed
inputs (``inputs.py``) and of the state tables' staged rows. Fields declared with ``staged()``
take part: ``Upload.send`` packs every such array into one pinned int64 buffer, copies it to
the device in one ``non_blocking`` copy and puts each array's device view in its field, in the
array's shape. 8-byte payloads only: integers as int64, floats as float64 (viewed as int64 bits
on the way). A ``staged()`` field may also hold another staged dataclass, or None.

Invariants:
- a pinned buffer is rewritten only after the copy that read it has run: the buffers form a
  ring, and each remembers the event recorded right after its copy;
- the device buffer is reused by the next step's copy, which the stream orders after every
  kernel of this step, so views handed out for a step stay valid for all of that step's work.
On the CPU there is no copy: views are the numpy arrays themselves, as tensors.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch

DEPTH = 4  # pinned buffers in the ring (up to three steps in flight, --overlap-depth 3, plus one)


def staged(**kw) -> Any:
    """A dataclass field the step's one upload fills: a numpy array until ``Upload.send``, its
    device tensor after; or a nested staged dataclass; or None."""
    return dataclasses.field(metadata={"staged": True}, **kw)


@functools.cache
def _staged_names(cls: type) -> tuple[str, ...]:
    """The ``staged()`` fields of a dataclass type, once per type (a step walks them every time)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("staged"))


def _host_arrays(obj, found: list) -> None:
    """(owner, field name, array) for every staged array under ``obj``, depth first, into ``found``."""
    for name in _staged_names(type(obj)):
        v = getattr(obj, name)
        if v is None:
            continue
        if isinstance(v, np.ndarray):
            found.append((obj, name, v))
        elif hasattr(type(v), "__dataclass_fields__"):
            _host_arrays(v, found)


def _as_int64(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "f":
        return np.ascontiguousarray(a, dtype=np.float64).view(np.int64)
    return np.ascontiguousarray(a, dtype=np.int64)


class Upload:
    """The staged arrays of one step's inputs (``add``), sent in one copy (``send``)."""

    def __init__(self, ring: "PinnedRing"):
        self._ring = ring
        self._objs: list = []

    def add(self, obj):
        """Register a staged dataclass (None: nothing) and return it."""
        if obj is not None:
            self._objs.append(obj)
        return obj

    def send(self) -> None:
        """Every registered object's staged arrays become device tensors of their shape, in one
        copy (none when every array is empty)."""
        found: list = []
        for obj in self._objs:
            _host_arrays(obj, found)
        if not found:  # a graph step whose bucket holds its slots: nothing to copy
            return
        views = self._ring.copy([_as_int64(a).reshape(-1) for _, _, a in found])
        for (owner, name, a), v in zip(found, views):
            v = v.view(torch.float64) if a.dtype.kind == "f" else v
            setattr(owner, name, v.view(a.shape))


class PinnedRing:
    """Pinned host buffers (a ring of DEPTH) and one device buffer for the steps' copies."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = device
        self.cuda = device.type == "cuda"
        self._host: list[torch.Tensor] = []
        self._events: list = [None] * DEPTH
        self._next = 0
        self._dev: torch.Tensor | None = None
        if self.cuda:
            self._grow(capacity)

    def upload(self) -> Upload:
        return Upload(self)

    def _grow(self, n: int) -> None:
        self._host = [torch.empty(n, dtype=torch.int64, pin_memory=True) for _ in range(DEPTH)]
        self._events = [None] * DEPTH  # old buffers stay alive until their copies are done
        self._dev = torch.empty(n, dtype=torch.int64, device=self.device)

    def copy(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Flat int64 arrays -> their device views, in one copy."""
        if not self.cuda:
            return [torch.from_numpy(a.copy() if not a.flags.writeable else a) for a in arrays]
        total = sum(_padded(a.size) for a in arrays)
        if total == 0:  # a decode step whose slots the graph buffer holds: nothing to copy
            return [self._dev[:0] for _ in arrays]
        if total > self._dev.numel():
            torch.cuda.current_stream().synchronize()  # rare: let queued copies finish first
            self._grow(max(total, 2 * self._dev.numel()))
        i = self._next
        self._next = (i + 1) % DEPTH
        if self._events[i] is not None:
            self._events[i].synchronize()  # normally long done: DEPTH steps ago
        host = self._host[i].numpy()
        off, spans = 0, []
        for a in arrays:
            host[off : off + a.size] = a
            spans.append((off, a.size))
            off += _padded(a.size)
        self._dev[:off].copy_(self._host[i][:off], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[i] = ev
        return [self._dev[o : o + n] for o, n in spans]


def _padded(n: int) -> int:
    """Each array starts 16-byte aligned (2 int64s): kernels see the same pointer alignment
    every step (Triton specialises on it)."""
    return n + (n & 1)
