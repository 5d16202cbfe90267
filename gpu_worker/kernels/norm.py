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

import dataclasses

import torch

from gpu_worker.kernels import next_pow2, pdl
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
    def _inv_rms(sum_sq, n_cols, eps):
        return tl.div_rn(1.0, tl.sqrt_rn(sum_sq / n_cols + eps))

    @triton.jit
    def _scaled(v, inv, w_ptr, cols, mask, HAS_W: tl.constexpr, GEMMA: tl.constexpr, DT: tl.constexpr):
        """v: float32 row piece (already rounded to DT) times its row's 1/rms and the weight,
        rounded to DT where HF rounds."""
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
    def _norm_row(v, w_ptr, cols, mask, n_cols, eps, HAS_W: tl.constexpr, GEMMA: tl.constexpr,
                  DT: tl.constexpr):
        """v: float32 row (already rounded to DT); returns the normed row rounded to DT."""
        return _scaled(v, _inv_rms(tl.sum(v * v, axis=0), n_cols, eps), w_ptr, cols, mask, HAS_W, GEMMA, DT)

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


    @triton.jit
    def _tile(ptr, off, m, CG: tl.constexpr):
        if CG:
            return tl.load(ptr + off, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        return tl.load(ptr + off, mask=m, other=0.0).to(tl.float32)

    @triton.jit
    def _scaled2(v, inv, w_ptr, cols, mask, HAS_W: tl.constexpr, GEMMA: tl.constexpr, DT: tl.constexpr):
        """``_scaled`` on a [rows, cols] tile with one 1/rms per row."""
        if GEMMA:
            y = v * inv[:, None]
            if HAS_W:
                y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)[None, :]
            return _rnd(y, DT)
        y = _rnd(v * inv[:, None], DT)
        if HAS_W:
            y = _rnd(y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)[None, :], DT)
        return y

    @triton.jit
    def norm_tail(y_ptr, sy, r_ptr, out_ptr, w1_ptr, w2_ptr, s_ptr, M, n_cols: tl.constexpr, eps,
                  MODE: tl.constexpr, HAS_W1: tl.constexpr, HAS_W2: tl.constexpr, HAS_SCALE: tl.constexpr,
                  GEMMA: tl.constexpr, MP: tl.constexpr, CHUNK: tl.constexpr):
        """``_norm_kernel``'s MODE_ADD_NORM (1) or MODE_NORM_ADD (2) on M (<= MP) rows at once,
        whose input ``y`` (row stride ``sy``) other programs of the calling kernel wrote (read
        bypassing L1), in [MP, CHUNK] passes so the caller (a GEMV's last program, ``gemv.py``)
        keeps its registers; ``r`` and ``out`` are contiguous [M, n_cols]. The passes are unrolled
        (``n_cols`` is a compile-time width) so each issues all its loads at once: the tail is a
        few memory round trips, not one per chunk. Same roundings as the one-pass kernel; each
        row's sum of squares is added in another order (fp32)."""
        DT = r_ptr.dtype.element_ty
        rows = tl.arange(0, MP)[:, None]
        rm = rows < M
        c = tl.arange(0, CHUNK)
        sq = tl.zeros([MP, CHUNK], tl.float32)
        if MODE == 1:  # r' = y + r; out = norm(r')
            for start in tl.static_range(0, n_cols, CHUNK):
                cm = start + c < n_cols
                m = rm & cm[None, :]
                r = _rnd(_tile(y_ptr, rows * sy + start + c[None, :], m, True)
                         + _tile(r_ptr, rows * n_cols + start + c[None, :], m, False), DT)
                tl.store(r_ptr + rows * n_cols + start + c[None, :], r.to(DT), mask=m)
                sq += r * r
            inv = _inv_rms(tl.sum(sq, axis=1), n_cols, eps)
            tl.debug_barrier()  # the stores above before the re-reads below, whichever thread
            for start in tl.static_range(0, n_cols, CHUNK):
                cm = start + c < n_cols
                m = rm & cm[None, :]
                r = _tile(r_ptr, rows * n_cols + start + c[None, :], m, True)
                tl.store(out_ptr + rows * n_cols + start + c[None, :],
                         _scaled2(r, inv, w1_ptr, start + c, cm, HAS_W1, GEMMA, DT).to(DT), mask=m)
        else:  # r' = r + norm1(y) [* scale]; out = norm2(r')
            for start in tl.static_range(0, n_cols, CHUNK):
                m = rm & (start + c < n_cols)[None, :]
                y = _tile(y_ptr, rows * sy + start + c[None, :], m, True)
                sq += y * y
            inv = _inv_rms(tl.sum(sq, axis=1), n_cols, eps)
            sq = tl.zeros([MP, CHUNK], tl.float32)
            for start in tl.static_range(0, n_cols, CHUNK):
                cm = start + c < n_cols
                m = rm & cm[None, :]
                y = _tile(y_ptr, rows * sy + start + c[None, :], m, True)
                r = _tile(r_ptr, rows * n_cols + start + c[None, :], m, False)
                r = _rnd(r + _scaled2(y, inv, w1_ptr, start + c, cm, HAS_W1, GEMMA, DT), DT)
                if HAS_SCALE:
                    r = _rnd(r * tl.load(s_ptr).to(tl.float32), DT)
                tl.store(r_ptr + rows * n_cols + start + c[None, :], r.to(DT), mask=m)
                sq += r * r
            if HAS_W2:
                inv = _inv_rms(tl.sum(sq, axis=1), n_cols, eps)
                tl.debug_barrier()
                for start in tl.static_range(0, n_cols, CHUNK):
                    cm = start + c < n_cols
                    m = rm & cm[None, :]
                    r = _tile(r_ptr, rows * n_cols + start + c[None, :], m, True)
                    tl.store(out_ptr + rows * n_cols + start + c[None, :],
                             _scaled2(r, inv, w2_ptr, start + c, cm, HAS_W2, GEMMA, DT).to(DT), mask=m)


@dataclasses.dataclass(frozen=True)
class RowNorm:
    """A norm step to run on a kernel's output ``y`` (``launch_norm``'s modes 1 and 2), for
    kernels that apply it in their epilogue (``gemv.py``): ``residual`` [M, N] is updated in
    place; the normed output (mode 1, or mode 2 with ``w2``) is returned by the kernel."""

    mode: int
    residual: torch.Tensor
    w1: torch.Tensor | None
    w2: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    eps: float = 1e-6
    gemma: bool = False

    @property
    def has_out(self) -> bool:
        return self.mode == MODE_ADD_NORM or self.w2 is not None


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
            GEMMA=gemma, BLOCK=block, PDL=on, num_warps=min(16, max(1, block // 256)), launch_pdl=on,
        )
    return out.view(x.shape) if want_out else None
