"""int32 / float32 arrays as bytes: the only way token and page ids cross a socket.

Packing a list and unpacking to a list use the stdlib's ``array``; numpy is imported only by the
functions that take or return numpy arrays (the scheduler and the worker), so the front, which
needs lists alone, never loads it (~10 MB resident).
"""

from __future__ import annotations

import sys
from array import array
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import numpy as np

I32 = "<i4"  # numpy dtype strings: little-endian on the wire, whatever the host
F32 = "<f4"
# The stdlib's "i" and "f" are int32 / float32 in the host's byte order; little-endian hosts
# (every one Tandem runs on) pack and unpack through them without numpy, ~5x faster for the
# scheduler's short per-row lists; others take numpy's byte-order-aware path.
_STDLIB = sys.byteorder == "little" and array("i").itemsize == 4 and array("f").itemsize == 4


def pack_i32(values: Iterable[int] | np.ndarray) -> bytes:
    if _STDLIB and type(values) is list:
        return array("i", values).tobytes()
    import numpy as np  # noqa: PLC0415 (see the module docstring)

    return np.asarray(values, dtype=I32).tobytes()


def pack_f32(values: Iterable[float] | np.ndarray) -> bytes:
    import numpy as np  # noqa: PLC0415

    return np.asarray(values, dtype=F32).tobytes()


def _unpack(code: str, dtype: str, buf: bytes) -> list[Any]:
    if _STDLIB:
        a = array(code)
        a.frombytes(buf)
        return a.tolist()
    import numpy as np  # noqa: PLC0415

    return np.frombuffer(buf, dtype=dtype).tolist()


def unpack_i32(buf: bytes) -> list[int]:
    """int32 bytes as a list of ints (no numpy)."""
    return _unpack("i", I32, buf)


def unpack_f32(buf: bytes) -> list[float]:
    """float32 bytes as a list of floats (each the float32 value exactly; no numpy)."""
    return _unpack("f", F32, buf)


def view_i32(buf: bytes) -> np.ndarray:
    """A read-only numpy view (no copy) of int32 bytes."""
    import numpy as np  # noqa: PLC0415

    return np.frombuffer(buf, dtype=I32)


def view_f32(buf: bytes) -> np.ndarray:
    import numpy as np  # noqa: PLC0415

    return np.frombuffer(buf, dtype=F32)
