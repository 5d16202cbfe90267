"""Which FP8 kernel multiplies x [M, K] by an FP8 weight (``quant/fp8.py``'s device path).

- one to four rows with quantized activations (plain decode at small batches, the MTP draft and
  verify at one request): ``fp8_gemv.py``'s tensor-core GEMV, which feeds the e4m3 weight to the
  tensor cores as it is and quantizes x in registers;
- one row, weight-only: ``fp8_gemv.py``'s one-row kernel;
- more rows (decode batches, prefill; weight-only from two rows): the FP8 GEMM (``fp8_gemm.py``),
  activations quantized by ``fp8_quant.py`` first where the format asks
  (docs/decisions/fp8.md).
A merged gate_up at one to four rows with quantized activations takes the tensor-core GEMV with
the activation in its epilogue (``fp8_gated_linear``); elsewhere the projection, then the
activation kernel. Every launch shape depends on the weight and the row count only (CUDA graphs
replay it).
"""

from __future__ import annotations

import torch

from gpu_worker.kernels.activation import ACTS
from gpu_worker.kernels.fp8_gemm import fp8_gemm
from gpu_worker.kernels.fp8_gemv import DOT_MAX_ROWS, fp8_gemv_dot, fp8_gemv_row
from gpu_worker.kernels.fp8_quant import quantize_acts

A8 = {"none": 0, "dynamic": 1, "static": 2}


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, scale_rows: int, acts: str,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (model dtype) through e4m3 ``w`` [N, K] with its scales -> [M, N] in x's dtype."""
    x = x if x.stride(1) == 1 else x.contiguous()
    if acts != "none" and x.shape[0] <= DOT_MAX_ROWS:
        return fp8_gemv_dot(x, w, scale, scale_rows, A8[acts], input_scale)
    if x.shape[0] == 1:
        return fp8_gemv_row(x, w, scale, scale_rows, A8[acts], input_scale)
    if acts == "none":
        return fp8_gemm(x, None, w, scale, scale_rows, x.dtype)
    xq, xs = quantize_acts(x, input_scale if acts == "static" else None)
    return fp8_gemm(xq, xs, w, scale, scale_rows, x.dtype, static=acts == "static")


def fp8_gated_linear(x: torch.Tensor, gate_up: torch.Tensor, scale: torch.Tensor, scale_rows: int, acts: str,
                     input_scale: torch.Tensor | None, act: str) -> torch.Tensor | None:
    """``act(x @ gate^T) * (x @ up^T)`` (gate_up = [gate; up] in e4m3) in one launch where the
    tensor-core GEMV takes x, else None: the caller runs ``fp8_linear`` and the activation."""
    if acts == "none" or act not in ACTS or not 1 <= x.shape[0] <= DOT_MAX_ROWS or x.stride(1) != 1:
        return None
    return fp8_gemv_dot(x, gate_up, scale, scale_rows, A8[acts], input_scale, act=act)
