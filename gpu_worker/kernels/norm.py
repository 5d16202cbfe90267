"""RMSNorm kernels, alone and fused with the residual add, one row per program.

Two flavours, each rounding exactly where HF transformers rounds, so a bf16 model gives HF's
bits and not merely close values:

- ``llama``: ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` (the product is rounded again);
- ``gemma``: ``(x * (mean(x^2) + eps) ** -0.5 * w).to(dtype)`` in float32; no weight = no scale.

Modes (one kernel, chosen at compile time):

- ``MODE_NORM``: ``out = norm(x)``;
- ``MODE_ADD_NORM`` (Llama's residual stream): ``r' = x + r``; ``out = norm(r')``; ``r`` <- ``r'``;
- ``MODE_NORM_ADD`` (Gemma's sandwich norms): ``r' = r + norm1(x)`` [``* scale``]; ``r`` <- ``r'``;
  with a second weight also ``out = norm2(r')``.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import PDL_ON, next_pow2, pdl
from gpu_worker.kernels.gdc import gdc_enter

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the torch reference path
    triton = None

MODE_NORM, MODE_ADD_NORM, MODE_NORM_ADD = 0, 1, 2

if triton is not None:

    @triton.jit
    def _rnd(x, DT: tl.constexpr):
        return x.to(DT).to(tl.float32)

    @triton.jit
    def _norm_row(v, w_ptr, cols, mask, n_cols, eps, HAS_W: tl.constexpr, GEMMA: tl.constexpr,
                  DT: tl.constexpr):
        """v: float32 row (already rounded to DT); returns the normed row rounded to DT."""
        ms = tl.sum(v * v, axis=0) / n_cols
        inv = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
        if GEMMA:
            y = v * inv
            if HAS_W:
                y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            return _rnd(y, DT)
        y = _rnd(v * inv, DT)
        if HAS_W:
            y = _rnd(y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32), DT)
        return y

    @triton.jit
    def _norm_kernel(x_ptr, r_ptr, w1_ptr, w2_ptr, s_ptr, out_ptr, n_cols, sx, sr, so, eps,
                     MODE: tl.constexpr, HAS_W1: tl.constexpr, HAS_W2: tl.constexpr,
                     HAS_SCALE: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        gdc_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        DT = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:
            y = _norm_row(x, w1_ptr, cols, mask, n_cols, eps, HAS_W1, GEMMA, DT)
            tl.store(out_ptr + row * so + cols, y.to(DT), mask=mask)
        elif MODE == 1:
            r = tl.load(r_ptr + row * sr + cols, mask=mask, other=0.0).to(tl.float32)
            r = _rnd(x + r, DT)
            tl.store(r_ptr + row * sr + cols, r.to(DT), mask=mask)
            y = _norm_row(r, w1_ptr, cols, mask, n_cols, eps, HAS_W1, GEMMA, DT)
            tl.store(out_ptr + row * so + cols, y.to(DT), mask=mask)
        else:
            r = tl.load(r_ptr + row * sr + cols, mask=mask, other=0.0).to(tl.float32)
            r = _rnd(r + _norm_row(x, w1_ptr, cols, mask, n_cols, eps, HAS_W1, GEMMA, DT), DT)
            if HAS_SCALE:
                r = _rnd(r * tl.load(s_ptr).to(tl.float32), DT)
            tl.store(r_ptr + row * sr + cols, r.to(DT), mask=mask)
            if HAS_W2:
                y = _norm_row(r, w2_ptr, cols, mask, n_cols, eps, HAS_W2, GEMMA, DT)
                tl.store(out_ptr + row * so + cols, y.to(DT), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def launch_norm(mode: int, x, residual, w1, w2, scale, eps: float, gemma: bool) -> torch.Tensor | None:
    """Run the kernel; ``residual`` (when used) is updated in place. Returns ``out`` or None."""
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    r2 = residual.view(-1, n_cols) if residual is not None else x2
    want_out = mode != MODE_NORM_ADD or w2 is not None
    out = torch.empty_like(x2) if want_out else x2
    if n_rows:
        block, on = next_pow2(n_cols), pdl(x2)
        _norm_kernel[(n_rows,)](
            x2, r2, w1 if w1 is not None else x2, w2 if w2 is not None else x2,
            scale if scale is not None else x2, out, n_cols, x2.stride(0), r2.stride(0), out.stride(0), eps,
            MODE=mode, HAS_W1=w1 is not None, HAS_W2=w2 is not None, HAS_SCALE=scale is not None,
            GEMMA=gemma, BLOCK=block, PDL=on, num_warps=min(16, max(1, block // 256)), launch_pdl=on == PDL_ON,
        )
    return out.view(x.shape) if want_out else None
