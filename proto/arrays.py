"""int32 / float32 arrays as bytes: the only way token and page ids cross a socket."""

from __future__ import annotations

import sys
from array import array
from typing import Iterable

import numpy as np

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")
# A list (the scheduler's per-row token and page lists, often one or two ids) packs through the
# stdlib's array ~5x faster than through numpy; its "i" is int32 little-endian where this holds.
_ARRAY_I32 = sys.byteorder == "little" and array("i").itemsize == 4


def pack_i32(values: Iterable[int] | np.ndarray) -> bytes:
    if _ARRAY_I32 and type(values) is list:
        return array("i", values).tobytes()
    return np.asarray(values, dtype=I32).tobytes()


def pack_f32(values: Iterable[float] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=F32).tobytes()


def view_i32(buf: bytes) -> np.ndarray:
    """A read-only view (no copy) of int32 bytes."""
    return np.frombuffer(buf, dtype=I32)


def view_f32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype=F32)
