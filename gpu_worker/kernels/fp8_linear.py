"""Which FP8 kernel multiplies x [M, K] by an FP8 weight (``quant/fp8.py``'s device path).

- one row (plain decode at one request, the MTP draft): ``fp8_gemv.py``'s one-row kernel (its
  gated variant for a merged gate_up with the activation);
- 2 to GEMV_MAX_M rows (MTP's verify at one request): the tensor-core GEMV (``gemv.py``'s kernel
  with scales; x quantized in its registers where the format asks), split-K past SKINNY_MAX_K and
  for launches with fewer column tiles than SMs, as in bf16;
- more rows: the FP8 GEMM (``fp8_gemm.py``), activations quantized by ``fp8_quant.py`` first
  where the format asks. A merged gate_up with the activation (``fp8_gated_linear``) keeps the
  tensor-core GEMV's gated epilogue up to 64 rows.
Every launch shape depends on the weight and the row count only (CUDA graphs replay it).
"""

from __future__ import annotations

import torch

from gpu_worker.kernels.activation import ACTS
from gpu_worker.kernels.fp8_gemm import fp8_gemm
from gpu_worker.kernels.fp8_gemv import fp8_gemv_row
from gpu_worker.kernels.fp8_quant import quantize_acts
from gpu_worker.kernels.gemv import (GEMV_MAX_M, LONG_K_SPLITS, SKINNY_MAX_K, WIDE_GATED, gemv, launch_tiles,
                                     short_k_splits)

A8 = {"none": 0, "dynamic": 1, "static": 2}
# The tensor-core GEMV's launch for FP8 weights at 2-4 rows: 128-column K tiles (one scale group).
DOT_CONFIG = dict(block_n=64, block_k=128, num_warps=4, num_stages=4, dot=True)


def gemv_splits(w: torch.Tensor, cfg: dict, device: torch.device, gated: bool = False) -> int:
    """K splits of the FP8 GEMV's launch ``cfg`` through ``w`` (the bf16 GEMV's rule)."""
    k = w.shape[1]
    if k > SKINNY_MAX_K:
        return LONG_K_SPLITS
    return short_k_splits(launch_tiles(w.shape[0], cfg, gated), k, cfg["block_k"], device)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, scale_rows: int, acts: str,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (model dtype) through e4m3 ``w`` [N, K] with its scales -> [M, N] in x's dtype."""
    x = _rows(x)
    m = x.shape[0]
    if m == 1:
        return fp8_gemv_row(x, w, scale, scale_rows, A8[acts], input_scale)
    if m <= GEMV_MAX_M:
        return gemv(x, w, splits=gemv_splits(w, DOT_CONFIG, x.device), scale=scale, scale_rows=scale_rows,
                    a8=A8[acts], input_scale=input_scale, **DOT_CONFIG)
    if acts == "none":
        return fp8_gemm(x, None, w, scale, scale_rows, x.dtype)
    xq, xs = quantize_acts(x, input_scale if acts == "static" else None)
    return fp8_gemm(xq, xs, w, scale, scale_rows, x.dtype, static=acts == "static")


def fp8_gated_linear(x: torch.Tensor, gate_up: torch.Tensor, scale: torch.Tensor, scale_rows: int, acts: str,
                     input_scale: torch.Tensor | None, act: str) -> torch.Tensor | None:
    """``act(x @ gate^T) * (x @ up^T)`` through a merged FP8 [gate; up]: the one-row kernel's
    gated variant at one row, the tensor-core GEMV's gated epilogue at 2-64 rows; or None (more
    rows, or a long K past GEMV_MAX_M rows): the caller runs the projection and the activation."""
    m = x.shape[0]
    if act not in ACTS or m > WIDE_GATED[-1][0]:
        return None
    if gate_up.shape[1] > SKINNY_MAX_K and m > GEMV_MAX_M:
        return None
    x = _rows(x)
    if m == 1:
        return fp8_gemv_row(x, gate_up, scale, scale_rows, A8[acts], input_scale, act=act)
    splits = gemv_splits(gate_up, DOT_CONFIG, x.device, gated=True) if m <= GEMV_MAX_M else 1
    return gemv(x, gate_up, act=act, splits=splits, scale=scale, scale_rows=scale_rows, a8=A8[acts],
                input_scale=input_scale, **DOT_CONFIG)
