"""Skinny GEMM for decode: ``y [M, N] = x [M, K] @ W [N, K]^T`` with M <= GEMV_MAX_M rows.

At one decode row the linear layers are weight streams: every weight byte is read once and
used M times. cuBLAS picks split-K kernels there for the smaller projections (a second,
reducing kernel per GEMM) and reaches ~70 % of copy bandwidth on the 30-50 MB ones. This kernel
splits only N: each program owns ``BLOCK_N`` output columns, streams their rows of W over the
whole K, and keeps M fp32 accumulators, so one launch writes the final bf16 result.

Two additions for the decode chain:

- PDL (``kernels/__init__.py``): before waiting for the previous kernel, a program prefetches the
  first ``PREFETCH_K`` columns of its weight rows into L2, so the weight stream starts while
  the norm / attention kernel before it finishes;
- ``gated_linear``: the MLP's ``down(act(gate) * up)`` in one launch, the input computed per
  chunk from the merged gate_up output with the rounding of ``gated_act`` (one kernel and one
  [M, I] round trip fewer per layer).

Rounding as F.linear: fp32 accumulation, one rounding to the output dtype at the end (the
summation order differs from cuBLAS's, as cuBLAS's differs between its own kernels).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from gpu_worker.kernels import pdl, use_triton
from gpu_worker.kernels.activation import ACTS
from gpu_worker.kernels.gdc import gdc_enter, prefetch_l2

try:
    import triton
    import triton.language as tl

    from gpu_worker.kernels.activation import gated_value
except ImportError:
    triton = None

GEMV_MAX_M = 4
# Where the kernel beat cuBLAS on the H200 (benchmarks/kernel_sweep.py, 2026-12-02, in a CUDA
# graph, weights rotated past L2): one row, K <= 8192, a weight of at least 16 MB — Llama-8B's
# qkv 16.5 -> 14.7 us, o 13.4 -> 11.9, gate_up 59.8 -> 54.8; its down (K = 14336) lost, 32.1 -> 34.5,
# and at four rows the kernel lost everywhere. Elsewhere cuBLAS stays.
SKINNY_MAX_K = 8192
SKINNY_MIN_WEIGHT = 8 << 20  # elements
CONFIG = dict(block_n=8, block_k=512, num_warps=4, num_stages=3)
PREFETCH_K = 1024  # weight columns per row pulled into L2 before the PDL wait (16 KB a program)


def fused_down_enabled() -> bool:
    """``gated_linear`` on: TANDEM_FUSED_DOWN=1. Off by default: on the H200 it measured slower
    than the act kernel + cuBLAS's split-K down (BENCHMARKS.md, 2026-12-02 evening)."""
    return os.environ.get("TANDEM_FUSED_DOWN", "0") != "0"


if triton is not None:

    @triton.jit
    def _x_chunk(x_ptr, row, k, km, K, ACT: tl.constexpr):
        """Input row ``row``'s columns ``k`` as float32: x itself, or act(gate) * up from the
        merged [gate | up] row when ACT >= 0."""
        if ACT < 0:
            x = tl.load(x_ptr + row + k, mask=km, other=0.0).to(tl.float32)
        else:
            g = tl.load(x_ptr + row + k, mask=km, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + row + K + k, mask=km, other=0.0).to(tl.float32)
            x = gated_value(g, u, ACT, x_ptr.dtype.element_ty)
        return x

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, sxm, swn, sym, M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr, PREFETCH_K: tl.constexpr):
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        if PREFETCH_K > 0:  # weights only, before the wait (one prefetch per 32-byte sector)
            sec = tl.minimum(tl.arange(0, PREFETCH_K // 16) * 16, K - 1)
            rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * swn
            prefetch_l2(rows + sec[None, :], PDL)
        gdc_enter(PDL)
        k0 = tl.arange(0, BLOCK_K)
        acc0 = tl.zeros([BLOCK_N], tl.float32)
        acc1 = tl.zeros([BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_N], tl.float32)
        acc3 = tl.zeros([BLOCK_N], tl.float32)
        w_rows = w_ptr + n.to(tl.int64)[:, None] * swn
        for start in range(0, K, BLOCK_K):
            k = start + k0
            km = k < K
            w = tl.load(w_rows + k[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
            acc0 += tl.sum(w * _x_chunk(x_ptr, 0, k, km, K, ACT)[None, :], axis=1)
            if M > 1:
                acc1 += tl.sum(w * _x_chunk(x_ptr, sxm, k, km, K, ACT)[None, :], axis=1)
            if M > 2:
                acc2 += tl.sum(w * _x_chunk(x_ptr, 2 * sxm, k, km, K, ACT)[None, :], axis=1)
            if M > 3:
                acc3 += tl.sum(w * _x_chunk(x_ptr, 3 * sxm, k, km, K, ACT)[None, :], axis=1)
        DT = y_ptr.dtype.element_ty
        tl.store(y_ptr + n, acc0.to(DT), mask=nm)
        if M > 1:
            tl.store(y_ptr + sym + n, acc1.to(DT), mask=nm)
        if M > 2:
            tl.store(y_ptr + 2 * sym + n, acc2.to(DT), mask=nm)
        if M > 3:
            tl.store(y_ptr + 3 * sym + n, acc3.to(DT), mask=nm)


def gemv(x: torch.Tensor, w: torch.Tensor, *, act: str | None = None, block_n: int = 16, block_k: int = 512,
         num_warps: int = 4, num_stages: int = 3, prefetch_k: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_M, unit column stride), w [N, K] contiguous -> [M, N].

    With ``act``, x is a merged [M, 2K] gate_up output and the product is
    ``(act(gate) * up) @ W^T``. ``prefetch_k`` overrides PREFETCH_K (benchmarks)."""
    m = x.shape[0]
    n, k = w.shape
    assert m <= GEMV_MAX_M and x.stride(1) == 1 and w.stride(1) == 1
    assert x.shape[1] == (2 * k if act else k), (x.shape, w.shape, act)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        on = pdl(x)
        pre = (PREFETCH_K if prefetch_k is None else prefetch_k) if on else 0
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x, w, y, n, k, x.stride(0), w.stride(0), y.stride(0), M=m, BLOCK_N=block_n, BLOCK_K=block_k,
            ACT=ACTS[act] if act else -1, PDL=on, PREFETCH_K=pre, num_warps=num_warps, num_stages=num_stages,
            launch_pdl=on,
        )
    return y


def _skinny(x: torch.Tensor, w: torch.Tensor, max_k: int) -> bool:
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and w.shape[1] <= max_k and w.numel() >= SKINNY_MIN_WEIGHT and x.stride(1) == 1
            and w.is_contiguous() and use_triton(x))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the GEMV where it measured faster (one decode row, mid-sized weight).
    Decode batches (16-256 rows) stay with cuBLAS: a Triton small-M GEMM (M x N tiles, split K)
    measured slower there on the H200 (BENCHMARKS.md, 2026-12-02 night)."""
    if bias is None and _skinny(x, w, SKINNY_MAX_K):
        return gemv(x, w, **CONFIG)
    return F.linear(x, w, bias)


def gated_linear(gate_up: torch.Tensor, w: torch.Tensor, act: str) -> torch.Tensor | None:
    """``down(act(gate) * up)`` in one GEMV for one decode row, or None where the caller should
    run the activation and the projection separately (more rows, small weights, CPU path)."""
    if not fused_down_enabled() or act not in ACTS or gate_up.shape[-1] != 2 * w.shape[1]:
        return None
    if not _skinny(gate_up, w, 1 << 30):
        return None
    return gemv(gate_up, w, act=act, **CONFIG)
