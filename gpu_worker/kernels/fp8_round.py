"""float32 -> float8 e4m3 inside our kernels: saturated at +-448, rounded to nearest even.

Compiled code converts with the hardware's ``cvt.rn.satfinite``. Triton's interpreter (CI) rounds
the mantissa but drops its carry into the exponent (7.95 became 4.0, not 8.0), so there the value
is first rounded to a representable one in float32 arithmetic, whose conversion is then exact:
the interpreter's results equal torch's ``.to(torch.float8_e4m3fn)`` (the references).
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import interpreting

try:
    import triton
    import triton.language as tl

    _EMULATE = tl.constexpr(interpreting())
except ImportError:
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value (the kernels spell it out: a jit function reads no plain global)
BLOCK = 128  # columns a scale covers: one K tile of the FP8 kernels

if triton is not None:

    @triton.jit
    def _round_e4m3(x):
        """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, in float32."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFFF + ((bits >> 20) & 1))) & -1048576  # 3 mantissa bits kept, carry kept
        normal = bits.to(tl.float32, bitcast=True)
        sub = ((x * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)  # below 2^-6: steps of 2^-9
        sub = tl.where(sub == 0.0, x * 0.0, sub)  # a zero keeps x's sign
        return tl.where(tl.abs(x) < 0.015625, sub, normal)

    @triton.jit
    def to_e4m3(x):
        """float32 -> float8 e4m3 (saturating, round to nearest even)."""
        x = tl.clamp(x, -448.0, 448.0)
        if _EMULATE:
            x = _round_e4m3(x)
        return x.to(tl.float8e4nv)
