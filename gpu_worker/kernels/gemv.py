"""Skinny GEMM for decode: ``y [M, N] = x [M, K] @ W [N, K]^T`` with M <= GEMV_MAX_M rows.

At one decode row the linear layers are weight streams: every weight byte is read once and
used M times. cuBLAS picks split-K kernels there for the smaller projections (a second,
reducing kernel per GEMM) and reaches ~70 % of copy bandwidth on the 30-50 MB ones. This kernel
splits only N: each program owns ``BLOCK_N`` output columns, streams their rows of W over the
whole K, and keeps M fp32 accumulators, so one launch writes the final bf16 result.

Rounding as F.linear: fp32 accumulation, one rounding to the output dtype at the end (the
summation order differs from cuBLAS's, as cuBLAS's differs between its own kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.kernels import use_triton

try:
    import triton
    import triton.language as tl
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


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, sxm, swn, sym, M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
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
            x = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
            acc0 += tl.sum(w * x[None, :], axis=1)
            if M > 1:
                x = tl.load(x_ptr + sxm + k, mask=km, other=0.0).to(tl.float32)
                acc1 += tl.sum(w * x[None, :], axis=1)
            if M > 2:
                x = tl.load(x_ptr + 2 * sxm + k, mask=km, other=0.0).to(tl.float32)
                acc2 += tl.sum(w * x[None, :], axis=1)
            if M > 3:
                x = tl.load(x_ptr + 3 * sxm + k, mask=km, other=0.0).to(tl.float32)
                acc3 += tl.sum(w * x[None, :], axis=1)
        DT = y_ptr.dtype.element_ty
        tl.store(y_ptr + n, acc0.to(DT), mask=nm)
        if M > 1:
            tl.store(y_ptr + sym + n, acc1.to(DT), mask=nm)
        if M > 2:
            tl.store(y_ptr + 2 * sym + n, acc2.to(DT), mask=nm)
        if M > 3:
            tl.store(y_ptr + 3 * sym + n, acc3.to(DT), mask=nm)


def gemv(x: torch.Tensor, w: torch.Tensor, *, block_n: int = 16, block_k: int = 512, num_warps: int = 4,
         num_stages: int = 3) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_M, unit column stride), w [N, K] contiguous -> [M, N]."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= GEMV_MAX_M and x.stride(1) == 1 and w.stride(1) == 1
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, y, n, k, x.stride(0), w.stride(0), y.stride(0), M=m,
                                                 BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
                                                 num_stages=num_stages)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the GEMV where it measured faster (one decode row, mid-sized weight)."""
    if (x.dim() == 2 and x.shape[0] == 1 and bias is None and x.dtype in (torch.bfloat16, torch.float16)
            and w.shape[1] <= SKINNY_MAX_K and w.numel() >= SKINNY_MIN_WEIGHT and x.stride(1) == 1
            and w.is_contiguous() and use_triton(x)):
        return gemv(x, w, **CONFIG)
    return F.linear(x, w, bias)
