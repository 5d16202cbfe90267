"""The FP8 GEMVs: y [M, N] = x [M, K] @ W^T for one to four rows (decode at small batches, the
MTP draft and verify at one request), W float8 e4m3 [N, K] with its scales (``fp8_math``'s
layout), x in the model dtype.

**The tensor-core GEMV** (``fp8_gemv_dot``: every row count where x is quantized) multiplies a
[BLOCK_N, 128] weight tile by x's tile padded to 16 rows, one 128-column scale group a K tile,
and adds the product to a float32 accumulator times the tile's scales. The weight reaches the
tensor cores as e4m3, with no conversion in registers; x's tile is quantized per row and group
in registers, as ``fp8_quant`` quantizes it (``_x_tile_q``), so no launch precedes it.

**The one-row loop** (``fp8_row_sums``: weight-only checkpoints at one row, and ``qkv_rope.py``'s
one-row qkv with RoPE) accumulates element-wise products in a [BLOCK_N, G, 128] float32 tile over
its K range and reduces once, at the end. x's tile is quantized per group as the format asks
(``A8`` 1 dynamic: amax / 448 of its 128 columns; 2 static: the one scale) and folded back with
its scale (``x_q * s``, as ``fp8_math.qdq_acts``), so the loop is a convert and a product-add per
weight byte (block scales, ``WS`` 2: one more product); the converts bound it below the copy
bandwidth, where the tensor-core GEMV is not (docs/decisions/fp8.md). Row scales (``WS`` 1)
multiply the sums once.

Split-K, the ticket protocol and the PDL prefetch are ``gemv.py``'s. A merged gate_up takes the
tensor-core GEMV with the activation in its epilogue (``act``: a tile holds gate rows and their up
rows, as ``gemv_kernels._dot_rows`` gathers them); the one-row loop's gated variant measured
slower than the projection then the activation kernel, so it has none.
"""
from __future__ import annotations

import torch

from gpu_worker.kernels import PDL_ON, pdl
from gpu_worker.kernels.activation import ACTS
from gpu_worker.kernels.fp8_round import BLOCK
from gpu_worker.kernels.gdc import gdc_enter, prefetch_l2
from gpu_worker.kernels.gemv import BIG_WEIGHT, LONG_K_SPLITS, SKINNY_MAX_K, prefetch_cols, short_k_splits, split_k

try:
    import triton
    import triton.language as tl

    from gpu_worker.kernels.fp8_round import to_e4m3
    from gpu_worker.kernels.gemv_kernels import _dot_rows, _reduce_row, _store_row, dot_tile_out, mma
except ImportError:
    triton = None

# BLOCK_N weight rows a program, G scale groups (G x 128 columns) a K tile: the fastest tile summed
# over the 8B and 9B shapes' projections (benchmarks/fp8_gemm_bench.py; docs/decisions/fp8.md).
ROW_CONFIG = dict(block_n=8, groups=4, num_warps=2, num_stages=4)
# The tensor-core kernel (``fp8_gemv_dot``), x padded to 16 rows: BLOCK_N weight rows a program,
# by weight (the fastest of benchmarks/fp8_gemm_bench.py's DOT_TRIES on the 8B and 9B shapes at
# 1-4 rows; docs/decisions/fp8.md): long K (split LONG_K_SPLITS ways), big weights, the rest.
DOT_LONG_K = dict(block_n=128, num_warps=4, num_stages=6)
DOT_BIG = dict(block_n=128, num_warps=8, num_stages=4)
DOT_CONFIG = dict(block_n=64, num_warps=4, num_stages=4)
DOT_MAX_ROWS = 4


def dot_config(n: int, k: int) -> dict:
    """The tensor-core GEMV's tile for an [n, k] weight."""
    if k > SKINNY_MAX_K:
        return DOT_LONG_K
    return DOT_BIG if n * k >= BIG_WEIGHT else DOT_CONFIG


def row_splits(n: int, k: int, cfg: dict, device: torch.device) -> int:
    """K splits of a launch through a weight of ``n`` rows, K ``k``: the bf16 GEMV's rule."""
    if k > SKINNY_MAX_K:
        return LONG_K_SPLITS
    return short_k_splits(-(-n // cfg["block_n"]), k, cfg["groups"] * BLOCK, device)


if triton is not None:

    @triton.jit
    def _x_groups(x_ptr, k, km, xs_ptr, A8: tl.constexpr):
        """x's K tile [G, 128] as float32: x itself, or quantized to e4m3 per group and times its
        scale (the format's value of x)."""
        x = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
        if A8 == 1:
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
            x = to_e4m3(x * tl.div_rn(448.0, amax)[:, None]).to(tl.float32) * tl.div_rn(amax, 448.0)[:, None]
        elif A8 == 2:
            s = tl.load(xs_ptr).to(tl.float32)
            x = to_e4m3(x * tl.div_rn(1.0, s)).to(tl.float32) * s
        return x

    @triton.jit
    def fp8_row_sums(rows_ptr, srow, s_ptr, x_ptr, xs_ptr, k_lo, k_hi, nm, BLOCK_N: tl.constexpr,
                     G: tl.constexpr, WS: tl.constexpr, A8: tl.constexpr):
        """float32 [BLOCK_N]: the weight rows at ``rows_ptr`` ([BLOCK_N] pointers; ``nm`` masks
        them) times x over columns k_lo..k_hi (k_lo a multiple of 128), with their scales
        (``srow``: the rows' scale-row offsets)."""
        kg = tl.arange(0, G)[:, None] * 128 + tl.arange(0, 128)[None, :]
        acc = tl.zeros([BLOCK_N, G, 128], tl.float32)
        for start in range(k_lo, k_hi, G * 128):
            k = start + kg
            km = k < k_hi
            x = _x_groups(x_ptr, k, km, xs_ptr, A8)
            w = tl.load(rows_ptr[:, None, None] + k[None, :, :], mask=nm[:, None, None] & km[None, :, :],
                        other=0.0).to(tl.float32)
            if WS == 2:
                gi = start // 128 + tl.arange(0, G)
                sm = nm[:, None] & (gi * 128 < k_hi)[None, :]
                w = w * tl.load(s_ptr + srow[:, None] + gi[None, :], mask=sm, other=0.0)[:, :, None]
            acc += w * x[None, :, :]
        sums = tl.sum(tl.sum(acc, axis=2), axis=1)
        if WS == 1:
            sums = sums * tl.load(s_ptr + srow)
        return sums

    @triton.jit
    def _fp8_row_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, tk_ptr, s_ptr, xs_ptr, N, K, K_CHUNK, swn, ss,
                        BLOCK_N: tl.constexpr, G: tl.constexpr, SPLITS: tl.constexpr,
                        PDL: tl.constexpr, PREFETCH_K: tl.constexpr, WS: tl.constexpr, A8: tl.constexpr,
                        SN: tl.constexpr):
        pid = tl.program_id(0)
        k_lo = tl.program_id(1) * K_CHUNK
        k_hi = tl.minimum(K, k_lo + K_CHUNK)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        nc = tl.minimum(n, N - 1)
        if PREFETCH_K > 0:  # weights only, before the wait (one prefetch per 32-byte sector)
            sec = tl.minimum(k_lo + tl.arange(0, PREFETCH_K // 32) * 32, K - 1)
            prefetch_l2(w_ptr + nc.to(tl.int64)[:, None] * swn + sec[None, :], PDL)
        gdc_enter(PDL)
        a = fp8_row_sums(w_ptr + n.to(tl.int64) * swn, (nc // SN) * ss, s_ptr, x_ptr, xs_ptr, k_lo, k_hi, nm,
                         BLOCK_N, G, WS, A8)
        _store_row(y_ptr, ws_ptr + tl.program_id(1) * 2 * N, 0, n, nm, a, a, N, SPLITS, -1)
        if SPLITS > 1:
            # as gemv_kernels.py: every partial store precedes the ticket, which releases them
            tl.debug_barrier()
            if tl.atomic_add(tk_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                _reduce_row(y_ptr, ws_ptr, 0, n, nm, N, 1, SPLITS, -1)
                tl.atomic_xchg(tk_ptr + pid, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _x_tile_q(x_ptr, sxm, r, rm, k, km, xs_ptr, A8: tl.constexpr):
        """x's K tile [MP, 128] as the tensor cores take it, and the per-row factor its products
        carry: e4m3 and amax / 448 of each row's 128 columns (``A8`` 1, ``_x_groups``' values),
        e4m3 and the static scale (2), or x and 1 (0: weight-only)."""
        x = tl.load(x_ptr + r[:, None] * sxm + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        f = tl.full(r.shape, 1.0, tl.float32)
        if A8 == 1:
            amax = tl.maximum(tl.max(tl.abs(x.to(tl.float32)), axis=1), 1e-12)
            x = to_e4m3(x.to(tl.float32) * tl.div_rn(448.0, amax)[:, None])
            f = tl.div_rn(amax, 448.0)
        elif A8 == 2:
            s = tl.load(xs_ptr).to(tl.float32)
            x = to_e4m3(x.to(tl.float32) * tl.div_rn(1.0, s))
            f = f * s
        return x, f

    @triton.jit
    def fp8_dot_sums(rows_ptr, srow, s_ptr, x_ptr, sxm, xs_ptr, k_lo, k_hi, nm, M: tl.constexpr, MP: tl.constexpr,
                     WS: tl.constexpr, A8: tl.constexpr, F32: tl.constexpr):
        """float32 [BLOCK_N, MP]: the weight rows at ``rows_ptr`` ([BLOCK_N] pointers; ``nm`` masks
        them) times x's M rows (padded to MP with zeros) over columns k_lo..k_hi, with their scales:
        per 128-column tile, (W tile @ x tile^T) times the tile's factors, on the tensor cores. The
        weight goes from memory to them as e4m3, never converted in registers (the one-row loop
        above converts every byte, which bounds it below the copy bandwidth)."""
        r = tl.arange(0, MP)
        rm = r < M
        acc = tl.zeros([rows_ptr.shape[0], MP], tl.float32)
        for start in range(k_lo, k_hi, 128):
            k = start + tl.arange(0, 128)
            km = k < k_hi
            w = tl.load(rows_ptr[:, None] + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            xq, xf = _x_tile_q(x_ptr, sxm, r, rm, k, km, xs_ptr, A8)
            if F32:  # the interpreter and float32 models: exact float32 products
                w, xq = w.to(tl.float32), xq.to(tl.float32)
            elif A8 == 0:
                w = w.to(xq.dtype)  # e4m3 -> x's dtype: exact
            part = mma(w, tl.trans(xq), tl.zeros_like(acc), F32) * xf[None, :]
            if WS == 2:
                part = part * tl.load(s_ptr + srow + start // 128, mask=nm, other=0.0)[:, None]
            acc += part
        if WS == 1:
            acc = acc * tl.load(s_ptr + srow)[:, None]
        return acc

    @triton.jit
    def _fp8_dot_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, tk_ptr, s_ptr, xs_ptr, N, K, K_CHUNK, sxm, swn, sym, ss,
                        M: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr,
                        SPLITS: tl.constexpr, PDL: tl.constexpr, PREFETCH_K: tl.constexpr, WS: tl.constexpr,
                        A8: tl.constexpr, SN: tl.constexpr, F32: tl.constexpr):
        """1..M rows on the tensor cores (``fp8_dot_sums``), split-K as the one-row kernel. Gated
        (``ACT`` >= 0): W is [gate; up] [2N, K], a program's tile BLOCK_N / 2 gate rows then their
        up rows (``_dot_rows``), and the epilogue writes ``act(gate) * up`` [M, N] rounded as the
        projection then the activation kernel."""
        pid = tl.program_id(0)
        k_lo = tl.program_id(1) * K_CHUNK
        k_hi = tl.minimum(K, k_lo + K_CHUNK)
        w_idx, nm = _dot_rows(pid, N, BLOCK_N, ACT)
        wc = tl.where(nm, w_idx, 0)
        r = tl.arange(0, MP)
        rm = r < M
        if PREFETCH_K > 0:  # weights only, before the wait (one prefetch per 32-byte sector)
            sec = tl.minimum(k_lo + tl.arange(0, PREFETCH_K // 32) * 32, K - 1)
            prefetch_l2(w_ptr + wc.to(tl.int64)[:, None] * swn + sec[None, :], PDL)
        gdc_enter(PDL)
        acc = fp8_dot_sums(w_ptr + w_idx.to(tl.int64) * swn, (wc // SN) * ss, s_ptr, x_ptr, sxm, xs_ptr, k_lo, k_hi,
                           nm, M, MP, WS, A8, F32)
        dot_tile_out(acc, y_ptr, ws_ptr, tk_ptr, w_idx, nm, r, rm, N, sym, M, MP, BLOCK_N, ACT, SPLITS)

def _pdl_prefetch(x: torch.Tensor, rows: int, splits: int, chunk: int, prefetch_k: int | None) -> tuple[int, int]:
    """The launch's PDL level and the weight columns a program prefetches before its wait (one
    prefetch per 32-byte sector of e4m3 weights: none below 32)."""
    on = pdl(x)
    if on != PDL_ON:
        return on, 0
    pre = prefetch_cols(rows, splits, chunk, elt=1) if prefetch_k is None else prefetch_k
    return on, pre if pre >= 32 else 0


def fp8_gemv_row(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, scale_rows: int, a8: int,
                 input_scale: torch.Tensor | None = None, splits: int | None = None, cfg: dict = ROW_CONFIG,
                 prefetch_k: int | None = None) -> torch.Tensor:
    """x [1, K] (unit column stride) through e4m3 ``w`` [N, K] -> [1, N] in x's dtype. ``splits``
    None: the launch rule (``row_splits``); ``prefetch_k`` overrides the PDL prefetch (benchmarks)."""
    k = x.shape[1]
    n = w.shape[0]
    assert x.shape[0] == 1 and x.stride(1) == 1 and w.stride(1) == 1 and w.shape[1] == k, (x.shape, w.shape)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    bn, g = cfg["block_n"], cfg["groups"]
    tiles = triton.cdiv(n, bn)
    splits = row_splits(n, k, cfg, x.device) if splits is None else splits
    chunk, splits, ws, tk = split_k(y, k, splits, g * BLOCK, tiles)
    on, pre = _pdl_prefetch(x, n, splits, chunk, prefetch_k)
    _fp8_row_kernel[(tiles, splits)](
        x, w, y, ws, tk, scale, input_scale if input_scale is not None else scale, n, k, chunk, w.stride(0),
        scale.stride(0), BLOCK_N=bn, G=g, SPLITS=splits, PDL=on, PREFETCH_K=pre,
        WS=1 if scale.shape[1] == 1 else 2, A8=a8, SN=scale_rows, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], launch_pdl=on == PDL_ON,
    )
    return y


def fp8_gemv_dot(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, scale_rows: int, a8: int,
                 input_scale: torch.Tensor | None = None, splits: int | None = None, cfg: dict | None = None,
                 prefetch_k: int | None = None, act: str | None = None) -> torch.Tensor:
    """x [M, K] (M <= DOT_MAX_ROWS, unit column stride) through e4m3 ``w`` [N, K] -> [M, N] in x's
    dtype, on the tensor cores. With ``act`` (``activation.ACTS``), w is a merged [gate; up]
    weight [2N', K] and the result ``act(x @ gate^T) * (x @ up^T)`` [M, N']. ``splits`` / ``cfg``
    None: the launch rule and ``dot_config``."""
    m, k = x.shape
    rows = w.shape[0]
    n = rows // 2 if act else rows
    cfg = cfg or dot_config(rows, k)
    assert 1 <= m <= DOT_MAX_ROWS and x.stride(1) == 1 and w.stride(1) == 1 and w.shape[1] == k, (x.shape, w.shape)
    assert not act or rows % 2 == 0, w.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bn = cfg["block_n"]
    tiles = triton.cdiv(n, bn // 2 if act else bn)
    if splits is None:
        splits = LONG_K_SPLITS if k > SKINNY_MAX_K else short_k_splits(tiles, k, BLOCK, x.device)
    chunk, splits, ws, tk = split_k(y, k, splits, BLOCK, tiles)
    on, pre = _pdl_prefetch(x, rows, splits, chunk, prefetch_k)
    _fp8_dot_kernel[(tiles, splits)](
        x, w, y, ws, tk, scale, input_scale if input_scale is not None else scale, n, k, chunk, x.stride(0),
        w.stride(0), y.stride(0), scale.stride(0), M=m, MP=16, BLOCK_N=bn, ACT=ACTS[act] if act else -1,
        SPLITS=splits, PDL=on, PREFETCH_K=pre, WS=1 if scale.shape[1] == 1 else 2, A8=a8, SN=scale_rows,
        F32=not x.is_cuda or x.dtype == torch.float32, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        launch_pdl=on == PDL_ON,
    )
    return y
