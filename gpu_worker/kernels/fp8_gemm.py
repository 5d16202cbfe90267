"""The FP8 GEMM for batches past the GEMV's rows (prefill chunks, large decode batches):
y [M, N] = x [M, K] @ W [N, K]^T with W float8 e4m3 and its scales (``fp8_math``'s layout).

One program per [BLOCK_M, BLOCK_N] output tile (grouped along M for L2 reuse of W), K in tiles
of 128 (one scale group):
- quantized activations (``A8`` 1: e4m3 x with scales [M, K/128], from ``fp8_quant``; 2: one
  static scale): the tile product runs on the FP8 tensor cores and is added to the float32
  accumulator times its scales each K tile (DeepSeek's promotion: the tensor cores' own
  accumulation over 128 columns only);
- weight-only (``A8`` 0): W's tile is converted to x's dtype in registers (exact) and multiplied
  on the bf16 tensor cores.
Row scales (``WS`` 1) multiply the sums once at the end; block scales (``WS`` 2) each K tile.
The sums are the exact products of the dequantized operands, in another order than the GEMV's.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels.fp8_round import BLOCK

try:
    import triton
    import triton.language as tl

    from gpu_worker.kernels.gemv_kernels import mma
except ImportError:
    triton = None

# (rows up to, config): small decode batches (and MTP's verify) stream W, prefill tiles are
# square-ish; the small-batch tiles are the sweep's fastest over the 8B and 9B shapes
# (benchmarks/fp8_gemm_bench.py).
CONFIGS = (
    (16, dict(block_m=16, block_n=32, num_warps=4, num_stages=4)),
    (32, dict(block_m=32, block_n=64, num_warps=4, num_stages=6)),
    (64, dict(block_m=64, block_n=64, num_warps=4, num_stages=6)),
    (256, dict(block_m=64, block_n=128, num_warps=4, num_stages=4)),
    (1 << 62, dict(block_m=128, block_n=128, num_warps=8, num_stages=3)),
)
GROUP_M = 8

if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, s_ptr, y_ptr, M, N, K, sam, sas, swn, ss, sym,
                         A8: tl.constexpr, WS: tl.constexpr, SN: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, F32: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP * tiles_n)
        first_m = group * GROUP
        size_m = tl.minimum(tiles_m - first_m, GROUP)
        pid_m = first_m + (pid % (GROUP * tiles_n)) % size_m
        pid_n = (pid % (GROUP * tiles_n)) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mm, nm = rm < M, rn < N
        srow = (tl.where(nm, rn, 0) // SN) * ss
        a_rows = a_ptr + rm.to(tl.int64)[:, None] * sam
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * swn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kt in range(0, tl.cdiv(K, BLOCK_K)):
            k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            km = k < K
            a = tl.load(a_rows + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            if F32:  # the interpreter, and a float32 model: exact float32 products
                a, w = a.to(tl.float32), w.to(tl.float32)
            elif A8 == 0:
                w = w.to(a.dtype)  # e4m3 -> x's dtype: exact
            if A8 == 0 and WS == 1:  # bf16 tensor cores accumulate in float32 themselves
                acc = mma(a, tl.trans(w), acc, F32)
            else:
                part = mma(a, tl.trans(w), tl.zeros_like(acc), F32)
                if A8 == 1:
                    part = part * tl.load(as_ptr + rm * sas + kt, mask=mm, other=0.0)[:, None]
                if WS == 2:
                    part = part * tl.load(s_ptr + srow + kt)[None, :]
                acc += part
        if A8 == 2:
            acc = acc * tl.load(as_ptr)
        if WS == 1:
            acc = acc * tl.load(s_ptr + srow)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])


def gemm_config(m: int) -> dict:
    return next(cfg for rows, cfg in CONFIGS if m <= rows)


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, scale: torch.Tensor, scale_rows: int,
             out_dtype: torch.dtype, static: bool = False, cfg: dict | None = None) -> torch.Tensor:
    """a [M, K]: e4m3 with ``a_scale`` ([M, K/128], or [1] with ``static``) or, weight-only
    (``a_scale`` None), x in the model dtype; w e4m3 [N, K] with ``scale`` -> [M, N] in
    ``out_dtype``."""
    m, k = a.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if not m:
        return y
    cfg = cfg or gemm_config(m)
    if a.element_size() == 4:  # float32 activations (a float32 model) fill twice the shared memory a stage
        cfg = dict(cfg, num_stages=min(cfg["num_stages"], 4))
    a8 = 0 if a_scale is None else (2 if static else 1)
    grid = (triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"]),)
    _fp8_gemm_kernel[grid](
        a, a_scale if a_scale is not None else scale, w, scale, y, m, n, k, a.stride(0),
        a_scale.stride(0) if a8 == 1 else 0, w.stride(0), scale.stride(0), y.stride(0),
        A8=a8, WS=1 if scale.shape[1] == 1 else 2, SN=scale_rows, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_K=BLOCK, GROUP=GROUP_M, F32=not a.is_cuda or a.dtype == torch.float32, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y
