"""Small-M GEMM for decode batches: ``y [M, N] = x [M, K] @ W [N, K]^T`` with tens to a few
hundred rows against a small weight (a 0.6B model's projections, a few MB each).

There cuBLAS is latency-bound: its tile choice leaves most SMs idle on an N = 1024 output
(24 CTAs for 132 SMs at 256 rows) and every projection took 6.4-8 us on the H200 for 4-12 MB
of weights, 15-37 % of copy bandwidth (benchmarks/kernel_sweep.py, 2026-12-02). This kernel
tiles M and N and splits K until the grid covers the SMs; with ``split_k > 1`` each split
writes an fp32 partial and a second kernel adds the partials in split order (deterministic: no
atomics) and rounds once.

Rounding as F.linear: fp32 accumulation, one rounding to the output dtype at the end (the
summation order differs from cuBLAS's, as cuBLAS's differs between its own kernels).

The grid's first axis walks the M tiles, so the programs that share a weight tile run side by
side and all but the first read it from L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.kernels import interpreting, next_pow2

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


if triton is not None:

    @triton.jit
    def _small_gemm_kernel(x_ptr, w_ptr, y_ptr, part_ptr, M, N, K, sxm, swn, sym,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mm, nm = rm < M, rn < N
        k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_span
        k_hi = tl.minimum(K, k_lo + k_span)
        rk = tl.arange(0, BLOCK_K)
        xp = x_ptr + rm[:, None].to(tl.int64) * sxm + rk[None, :]
        wp = w_ptr + rn[:, None].to(tl.int64) * swn + rk[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                a = tl.load(xp + k0, mask=mm[:, None], other=0.0)
                b = tl.load(wp + k0, mask=nm[:, None], other=0.0)
            else:
                km = (k0 + rk) < k_hi
                a = tl.load(xp + k0, mask=mm[:, None] & km[None, :], other=0.0)
                b = tl.load(wp + k0, mask=nm[:, None] & km[None, :], other=0.0)
            if IEEE:  # the interpreter (no bf16 dot) and fp32 inputs
                acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        out = mm[:, None] & nm[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptr + rm[:, None].to(tl.int64) * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out)
        else:
            base = (pid_k * M + rm[:, None].to(tl.int64)) * N + rn[None, :]
            tl.store(part_ptr + base, acc, mask=out)

    @triton.jit
    def _split_sum_kernel(part_ptr, y_ptr, M, N, sym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        # Partials added in split order: the same bits on every run.
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < M * N
        acc = tl.load(part_ptr + i, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(part_ptr + s * M * N + i, mask=mask, other=0.0)
        row, col = i // N, i % N
        tl.store(y_ptr + row.to(tl.int64) * sym + col, acc.to(y_ptr.dtype.element_ty), mask=mask)


def pick_config(m: int, n: int, k: int, sms: int) -> GemmConfig:
    """Tiles for M rows: BLOCK_M covers the rows in one or two tiles, BLOCK_N = 64, and K is
    split (a power of two, each split at least 256 columns) until the grid fills the SMs once.
    A function of the shape only, so a CUDA graph replays what it captured."""
    block_m = min(128, max(16, next_pow2(m)))
    if block_m == 128 and m <= 96:
        block_m = 64
    block_n, block_k = 64, 128
    tiles = triton_cdiv(m, block_m) * triton_cdiv(n, block_n)
    split = 1
    while tiles * split * 2 <= sms and k // (split * 2) >= 256:
        split *= 2
    warps = 8 if block_m >= 128 else 4
    return GemmConfig(block_m, block_n, block_k, split, num_warps=warps, num_stages=4)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def small_gemm(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig | None = None, sms: int | None = None) -> torch.Tensor:
    """x [M, K] (unit column stride), w [N, K] contiguous -> [M, N] in x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1, (x.shape, w.shape)
    if cfg is None:
        cfg = pick_config(m, n, k, sms or device_sms(x.device))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    split = cfg.split_k
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    even = k % cfg.block_k == 0  # every split starts on a BLOCK_K boundary: only K's tail can be ragged
    grid = (triton_cdiv(m, cfg.block_m), triton_cdiv(n, cfg.block_n), split)
    _small_gemm_kernel[grid](x, w, y, part, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
                             EVEN_K=even, IEEE=x.dtype == torch.float32 or interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton_cdiv(m * n, block),)](part, y, m, n, y.stride(0), SPLIT_K=split, BLOCK=block,
                                                       num_warps=4)
    return y


_SMS: dict[str, int] = {}


def device_sms(dev: torch.device) -> int:
    key = str(dev)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
    return _SMS[key]
