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

Split-K (``gemm_splits``): a launch with fewer output tiles than the GPU has SMs (a decode batch
through a narrow projection: 64 tiles for the 8B's o and down at 64 rows) leaves SMs idle and
streams W at a fraction of the bandwidth, so K is cut into ``SPLITS`` chunks, one program each;
they store float32 partials and take a ticket per tile, and the last taker sums the partials in
split order (deterministic) -- the GEMV's protocol. ``SPLITS`` is a runtime argument: split and
unsplit launches are one compiled kernel.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import TICKETS, tickets
from gpu_worker.kernels.fp8_round import BLOCK
from gpu_worker.kernels.gemv import sm_count

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
# Split-K: launches of fewer tiles than SMs split K until they have SPLIT_FILL programs per SM,
# each chunk at least SPLIT_MIN_TILES K tiles (benchmarks/fp8_gemm_bench.py's split sweep).
SPLIT_FILL = 1
SPLIT_MIN_TILES = 16

if triton is not None:

    @triton.jit(do_not_specialize=["M", "SPLITS"])
    def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, tk_ptr, M, N, K, K_TILES, SPLITS, sam, sas, swn,
                         ss, sym, A8: tl.constexpr, WS: tl.constexpr, SN: tl.constexpr, BLOCK_M: tl.constexpr,
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
        kt_lo = tl.program_id(1) * K_TILES
        for kt in range(kt_lo, tl.minimum(kt_lo + K_TILES, tl.cdiv(K, BLOCK_K))):
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
        out_m = mm[:, None] & nm[None, :]
        if SPLITS == 1:
            tl.store(y_ptr + rm.to(tl.int64)[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_m)
        else:
            # partials [SPLITS, M, N]; every store precedes the ticket (the barrier), which releases them
            tile = rm[:, None] * N + rn[None, :]
            tl.store(ws_ptr + tl.program_id(1) * M * N + tile, acc, mask=out_m)
            tl.debug_barrier()
            if tl.atomic_add(tk_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for sp in range(SPLITS):
                    total += tl.load(ws_ptr + sp * M * N + tile, mask=out_m, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + rm.to(tl.int64)[:, None] * sym + rn[None, :], total.to(y_ptr.dtype.element_ty),
                         mask=out_m)
                tl.atomic_xchg(tk_ptr + pid, 0, sem="relaxed", scope="gpu")


def gemm_config(m: int) -> dict:
    return next(cfg for rows, cfg in CONFIGS if m <= rows)


def gemm_splits(tiles: int, k: int, device: torch.device) -> int:
    """K chunks of a launch of ``tiles`` output tiles over K ``k``: one while the tiles cover the
    SMs, else as many as bring the launch to SPLIT_FILL programs per SM, each chunk at least
    SPLIT_MIN_TILES K tiles long."""
    sms = sm_count(device)
    if tiles >= sms:
        return 1
    return max(1, min(-(-SPLIT_FILL * sms // tiles), -(-k // BLOCK) // SPLIT_MIN_TILES))


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, scale: torch.Tensor, scale_rows: int,
             out_dtype: torch.dtype, static: bool = False, cfg: dict | None = None,
             splits: int | None = None) -> torch.Tensor:
    """a [M, K]: e4m3 with ``a_scale`` ([M, K/128], or [1] with ``static``) or, weight-only
    (``a_scale`` None), x in the model dtype; w e4m3 [N, K] with ``scale`` -> [M, N] in
    ``out_dtype``. ``splits`` None: ``gemm_splits``' count (benchmarks and tests pass one)."""
    m, k = a.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if not m:
        return y
    cfg = cfg or gemm_config(m)
    if a.element_size() == 4:  # float32 activations (a float32 model) fill twice the shared memory a stage
        cfg = dict(cfg, num_stages=min(cfg["num_stages"], 4))
    a8 = 0 if a_scale is None else (2 if static else 1)
    tiles = triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"])
    k_tiles = triton.cdiv(k, BLOCK)
    splits = max(1, min(gemm_splits(tiles, k, a.device) if splits is None else splits, k_tiles))
    chunk = triton.cdiv(k_tiles, splits)
    splits = triton.cdiv(k_tiles, chunk)  # no empty chunk: every program takes its ticket after real work
    assert splits == 1 or tiles <= TICKETS, (m, n, tiles)
    ws = torch.empty((splits, m, n) if splits > 1 else (0,), dtype=torch.float32, device=a.device)
    _fp8_gemm_kernel[(tiles, splits)](
        a, a_scale if a_scale is not None else scale, w, scale, y, ws, tickets(a.device), m, n, k, chunk, splits,
        a.stride(0),
        a_scale.stride(0) if a8 == 1 else 0, w.stride(0), scale.stride(0), y.stride(0),
        A8=a8, WS=1 if scale.shape[1] == 1 else 2, SN=scale_rows, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_K=BLOCK, GROUP=GROUP_M, F32=not a.is_cuda or a.dtype == torch.float32, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y
