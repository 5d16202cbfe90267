"""Activation quantization for the FP8 GEMM: x [M, K] -> e4m3 [M, K] and its scales.

Dynamic: one scale per token and 128 columns, ``amax / 448``, the values ``x * (448 / amax)``
rounded to e4m3 (``fp8_math.quantize_groups`` bit for bit: the same float32 divisions and
products, round to nearest even). Static: the one calibrated scale ``s``, values ``x * (1 / s)``.
One program per (row, GROUPS groups of 128 columns): no pass over the row reads another's data,
so the kernel is as cheap as one read of x and one write of half its bytes.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels.fp8_round import BLOCK, FP8

try:
    import triton
    import triton.language as tl

    from gpu_worker.kernels.fp8_round import to_e4m3
except ImportError:
    triton = None

GROUPS = 8  # 128-column groups a program quantizes

if triton is not None:

    @triton.jit
    def _quant_kernel(x_ptr, q_ptr, s_ptr, xs_ptr, K, KB, sxm, sqm, ssm, STATIC: tl.constexpr,
                      GROUPS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        k = g[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        km = (k < K) & (g < KB)[:, None]
        x = tl.load(x_ptr + row * sxm + k, mask=km, other=0.0).to(tl.float32)
        if STATIC:
            q = to_e4m3(x * tl.div_rn(1.0, tl.load(xs_ptr)))
        else:
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
            q = to_e4m3(x * tl.div_rn(448.0, amax)[:, None])
            tl.store(s_ptr + row * ssm + g, tl.div_rn(amax, 448.0), mask=g < KB)
        tl.store(q_ptr + row * sqm + k, q, mask=km)


def quantize_acts(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (e4m3 [M, K], float32 scales [M, ceil(K / 128)]), or with
    ``input_scale`` (static) the values and that scale itself."""
    m, k = x.shape
    kb = -(-k // BLOCK)
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = input_scale if input_scale is not None else torch.empty((m, kb), dtype=torch.float32, device=x.device)
    if m:
        _quant_kernel[(m, triton.cdiv(kb, GROUPS))](
            x, q, s, s, k, kb, x.stride(0), q.stride(0), s.stride(0) if input_scale is None else 0,
            STATIC=input_scale is not None, GROUPS=GROUPS, BLOCK=BLOCK, num_warps=4,
        )
    return q, s
