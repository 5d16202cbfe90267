"""Paged extend attention: prefill chunks over a paged prefix (chunked prefill, prefix-cache hits).

The chunk's own K/V are stored in the pool first (``rope.rope_store``), so every key — cached
prefix or new — is read the same way, through the row's page table. One program per (query
block, query head); a query block is up to BLOCK_M consecutive tokens of one row, described by
host-built metadata (``extend_blocks``): its row, first flat token and token count. The mask rule
is the backend contract: key j visible to query at ``q_pos`` iff ``j < kv_len``, ``j <= q_pos``
and on sliding layers ``j > q_pos - window``; keys outside ``[min q_pos - window, max q_pos]``
of the block are never loaded.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.kernels import interpreting, next_pow2

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    # The index arrays are per-step views (rows of the [3, NB] block table, staging slices): no
    # alignment specialisation, so their offsets never trigger a recompile mid-serving.
    @triton.jit(do_not_specialize_on_alignment=["slot_ptr", "kvlen_ptr", "qpos_ptr", "brow_ptr", "bstart_ptr",
                                                "blen_ptr"])
    def _extend_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, pt_ptr, slot_ptr, kvlen_ptr, qpos_ptr, brow_ptr, bstart_ptr, blen_ptr,
        sqt, sqh, skn, skh, svn, svh, sot, soh, spt, scale, softcap, window, v_scale,
        G: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
        USE_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    ):
        blk = tl.program_id(0)
        qh = tl.program_id(1)
        kvh = qh // G
        row = tl.load(brow_ptr + blk).to(tl.int64)
        t0 = tl.load(bstart_ptr + blk).to(tl.int64)
        nq = tl.load(blen_ptr + blk)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        kv_len = tl.load(kvlen_ptr + row).to(tl.int32)
        m = tl.arange(0, BLOCK_M)
        mvalid = m < nq
        tok = t0 + m
        qpos = tl.load(qpos_ptr + tok, mask=mvalid, other=-1).to(tl.int32)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        q = tl.load(q_ptr + tok[:, None] * sqt + qh * sqh + d[None, :], mask=mvalid[:, None] & dm[None, :],
                    other=0.0)
        hi = tl.minimum(kv_len, tl.max(qpos, axis=0) + 1)
        lo = 0
        if USE_WINDOW:
            lo = tl.maximum(0, tl.min(tl.where(mvalid, qpos, 2147483647), axis=0) - window + 1)
            lo = (lo // BLOCK_N) * BLOCK_N
        dv = tl.arange(0, BLOCK_DV)
        dvm = dv < DV
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nm = n < hi
            page = tl.load(pt_ptr + slot * spt + n // PAGE, mask=nm, other=0).to(tl.int64)
            loc = page * PAGE + n % PAGE
            k = tl.load(k_ptr + loc[:, None] * skn + kvh * skh + d[None, :], mask=nm[:, None] & dm[None, :],
                        other=0.0).to(q.dtype)  # an FP8 pool's values are exact in q's dtype
            if IEEE:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            if USE_SOFTCAP:
                s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
            vis = nm[None, :] & (n[None, :] <= qpos[:, None])
            if USE_WINDOW:
                vis = vis & (n[None, :] > qpos[:, None] - window)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + loc[:, None] * svn + kvh * svh + dv[None, :], mask=nm[:, None] & dvm[None, :],
                        other=0.0).to(q.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale  # v_scale: 1.0 but for an FP8 pool
        tl.store(o_ptr + tok[:, None] * sot + qh * soh + dv[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=mvalid[:, None] & dvm[None, :])


def extend_block_m(head_dims: list[int]) -> int:
    """Query-block size for a model: one for every layer, so one host metadata table serves all."""
    return 64 if max(head_dims) <= 256 else 32


def _key_tile(d: int, dv: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) by head size."""
    big = max(d, dv)
    if big <= 128:
        return 64, 4
    if big <= 256:
        return 32, 8
    return 16, 8


def extend_blocks(q_lens: np.ndarray, block_m: int) -> np.ndarray:
    """Host metadata [3, NB]: for each query block its row, first flat token, token count."""
    q_lens = np.asarray(q_lens, dtype=np.int64)
    nblk = -(-q_lens // block_m)
    rows = np.repeat(np.arange(len(q_lens)), nblk)
    first = np.repeat(np.cumsum(q_lens) - q_lens, nblk)
    within = np.arange(int(nblk.sum())) - np.repeat(np.cumsum(nblk) - nblk, nblk)
    start = first + within * block_m
    count = np.minimum(block_m, np.repeat(q_lens, nblk) - within * block_m)
    return np.stack([rows, start, count]).astype(np.int64)


def paged_extend(q, k_cache, v_cache, page_table, slots, kv_lens, q_pos, blocks, *, block_m: int,
                 page_size: int, scale: float, window: int | None = None, softcap: float | None = None,
                 out: torch.Tensor | None = None, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """q [N, Hq, D] -> out [N, Hq, Dv]. ``blocks`` [3, NB] on the device (``extend_blocks`` with the
    same ``block_m``), ``slots``/``kv_lens`` per row, ``q_pos`` per token; an FP8 cache is read
    with its (k scale, v scale) ``kv_scales`` (``kv_pool.py``)."""
    n, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[-1]
    if out is None:
        out = torch.empty((n, hq, dv), dtype=q.dtype, device=q.device)
    nb = blocks.shape[1]
    if nb == 0:
        return out
    bn, warps = _key_tile(d, dv)
    _extend_kernel[(nb, hq)](
        q, k_cache, v_cache, out, page_table, slots, kv_lens, q_pos, blocks[0], blocks[1], blocks[2],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), scale * kv_scales[0], softcap or 0.0, window or 0,
        kv_scales[1], G=hq // hkv, PAGE=page_size, D=d, DV=dv, BLOCK_D=next_pow2(d), BLOCK_DV=next_pow2(dv), BLOCK_M=block_m,
        BLOCK_N=bn, USE_WINDOW=window is not None, USE_SOFTCAP=softcap is not None,
        IEEE=q.dtype == torch.float32 or interpreting(), num_warps=warps, num_stages=2,
    )
    return out
