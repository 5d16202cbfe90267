"""Paged decode attention: few queries per row (decode T=1, MTP verify T=S+1, the frozen-KV
draft's Q-only read), every row reading its own pages through the page table.

One program per (row, KV head, split) computes all ``T * group`` queries that share the KV head
(GQA packed into one tile: K/V are read once per KV head, not once per query head). Query token
t of row b at mask position ``q_pos`` sees key j iff ``j < kv_len[b]``, ``j <= q_pos`` and, on
a sliding layer, ``j > q_pos - window`` — the backend contract of ``attention/base.py``.

Split-KV (flash-decoding): with few rows the key range is cut into ``num_splits`` pieces that
run in parallel and are merged by log-sum-exp — by the last split of each (row, KV head) to
finish, which takes a ticket (``kernels/__init__.py``) and reads the others' partials (a second
kernel merges when the launch has more (row, KV head) pairs than tickets); the split count
depends only on the batch bucket, so the launch is the same on every CUDA-graph replay (splits
past the row's keys store an empty partial at once). A query row that saw no key of a split writes only its -inf log-sum-exp, and both
merges skip such partials without reading them. Rows with no visible key (graph padding) produce
zeros, never NaN.

PDL (``kernels/__init__.py``): launched early, a program loads its row's lengths, positions and
page entries and its split's first key tile before waiting for the previous kernel; keys at or
past the row's first query position (this forward's, which that kernel may still be storing)
are loaded after the wait and replace theirs in the tile. The arithmetic is the loop's.

Launch order (``order``): rows of one batch can differ 20x in length (a served mix), and with
more programs than the SMs hold at once the GPU starts them in grid order, so a long row that
starts last runs alone at the end. Given a permutation of the rows, longest first, the grid is
(KV head, rank, split) and program (h, r) serves row ``order[r]``: every head of the longest row
starts first (longest-processing-time-first scheduling). Only the launch order changes; each
row's arithmetic is the same.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import PDL_ON, TICKETS, interpreting, next_pow2, pdl, tickets
from gpu_worker.kernels.gdc import gdc_enter

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _locations(pt_ptr, slot, spt, n, nm, PAGE: tl.constexpr):
        """Pool locations of keys n of a row (page table row ``slot``)."""
        page = tl.load(pt_ptr + slot * spt + n // PAGE, mask=nm, other=0).to(tl.int64)
        return page * PAGE + n % PAGE

    @triton.jit
    def _kv_tile(k_ptr, v_ptr, loc, mask, kvh, skn, skh, svn, svh, d, dm, dv, dvm, DT: tl.constexpr):
        """K [BLOCK_N, BLOCK_D] and V [BLOCK_N, BLOCK_DV] of one KV head at ``loc`` (zeros where
        ``mask`` is off), in the query's dtype ``DT``: an FP8 pool's e4m3 values are exact there
        (their scales are applied by the caller: k's in the softmax scale, v's to the output)."""
        k = tl.load(k_ptr + loc[:, None] * skn + kvh * skh + d[None, :], mask=mask[:, None] & dm[None, :], other=0.0)
        v = tl.load(v_ptr + loc[:, None] * svn + kvh * svh + dv[None, :], mask=mask[:, None] & dvm[None, :],
                    other=0.0)
        return k.to(DT), v.to(DT)

    @triton.jit
    def _attend(q, k, v, n, nm, qpos, m_i, l_i, acc, scale, softcap, window, USE_WINDOW: tl.constexpr,
                USE_SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
        """One key tile into the running max, sum and output (online softmax)."""
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
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    # Per-call views (a row group's slice of q, out and the index arrays) start at varying offsets:
    # specialising on their 16-byte alignment would JIT-compile new variants mid-serving (each a
    # latency spike). Unused pointers (order_ptr unordered, po_ptr / plse_ptr with one split)
    # receive the whole page table, whose alignment never varies.
    @triton.jit(do_not_specialize_on_alignment=["q_ptr", "o_ptr", "slot_ptr", "kvlen_ptr", "qpos_ptr"])
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, po_ptr, plse_ptr, pt_ptr, slot_ptr, kvlen_ptr, qpos_ptr, order_ptr, tk_ptr,
        sqt, sqh, skn, skh, svn, svh, sot, soh, spt, scale, softcap, window, v_scale,
        T: tl.constexpr, G: tl.constexpr, HKV: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
        PDL: tl.constexpr, ORDERED: tl.constexpr, FUSED_MERGE: tl.constexpr,
    ):
        if ORDERED:
            kvh = tl.program_id(0)
            b = tl.load(order_ptr + tl.program_id(1)).to(tl.int64)
        else:
            b = tl.program_id(0).to(tl.int64)
            kvh = tl.program_id(1)
        split = tl.program_id(2)
        # the row's step inputs (written before the previous kernel started: safe before the wait)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        kv_len = tl.load(kvlen_ptr + b).to(tl.int32)
        m = tl.arange(0, BLOCK_M)
        mvalid = m < T * G
        tok = b * T + m // G
        qh = kvh * G + m % G
        qpos = tl.load(qpos_ptr + tok, mask=mvalid, other=-1).to(tl.int32)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        hi = tl.minimum(kv_len, tl.max(qpos, axis=0) + 1)
        lo = 0
        if USE_WINDOW:
            lo = tl.maximum(0, tl.min(tl.where(mvalid, qpos, 2147483647), axis=0) - window + 1)
        span = tl.maximum(hi - lo, 0)
        chunk = tl.cdiv(tl.cdiv(span, SPLITS), BLOCK_N) * BLOCK_N
        s_lo = lo + split * chunk
        s_hi = tl.minimum(hi, s_lo + chunk)
        dv = tl.arange(0, BLOCK_DV)
        dvm = dv < DV
        if PDL == 2:
            # Launched early (PDL): the split's first key tile is read before the wait, except the
            # keys at the row's query positions and past them, which this forward writes (the
            # previous kernel may still be storing them); those are read after it.
            fresh_from = tl.min(tl.where(mvalid, qpos, 2147483647), axis=0)
            n0 = s_lo + tl.arange(0, BLOCK_N)
            nm0 = n0 < s_hi
            loc0 = _locations(pt_ptr, slot, spt, n0, nm0, PAGE)
            k0, v0 = _kv_tile(k_ptr, v_ptr, loc0, nm0 & (n0 < fresh_from), kvh, skn, skh, svn, svh, d, dm, dv, dvm,
                              q_ptr.dtype.element_ty)
        gdc_enter(PDL)
        q = tl.load(q_ptr + tok[:, None] * sqt + qh[:, None] * sqh + d[None, :],
                    mask=mvalid[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        first = s_lo
        if PDL == 2:
            if s_lo < s_hi:
                fresh = nm0 & (n0 >= fresh_from)
                k1, v1 = _kv_tile(k_ptr, v_ptr, loc0, fresh, kvh, skn, skh, svn, svh, d, dm, dv, dvm,
                                  q_ptr.dtype.element_ty)
                k0 = tl.where(fresh[:, None], k1, k0)
                v0 = tl.where(fresh[:, None], v1, v0)
                m_i, l_i, acc = _attend(q, k0, v0, n0, nm0, qpos, m_i, l_i, acc, scale, softcap, window,
                                        USE_WINDOW, USE_SOFTCAP, IEEE)
            first = s_lo + BLOCK_N
        for start in range(first, s_hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nm = n < s_hi
            loc = _locations(pt_ptr, slot, spt, n, nm, PAGE)
            k, v = _kv_tile(k_ptr, v_ptr, loc, nm, kvh, skn, skh, svn, svh, d, dm, dv, dvm, q_ptr.dtype.element_ty)
            m_i, l_i, acc = _attend(q, k, v, n, nm, qpos, m_i, l_i, acc, scale, softcap, window,
                                    USE_WINDOW, USE_SOFTCAP, IEEE)
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None] * v_scale  # v_scale: 1.0 but for an FP8 pool
        if SPLITS == 1:
            tl.store(o_ptr + tok[:, None] * sot + qh[:, None] * soh + dv[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=mvalid[:, None] & dvm[None, :])
        else:
            row = (tok * (G * HKV) + qh) * SPLITS + split  # [N, Hq, SPLITS]
            lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(plse_ptr + row, lse, mask=mvalid)
            # a query row that saw no key of this split writes only its -inf lse: merges skip it
            tl.store(po_ptr + row[:, None] * BLOCK_DV + dv[None, :], out, mask=(mvalid & has)[:, None])
            if FUSED_MERGE:  # the last split of (row, KV head) to finish merges them all
                tl.debug_barrier()  # every thread's partials precede the ticket, which releases them
                if tl.atomic_add(tk_ptr + b * HKV + kvh, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                    _merge_tile(po_ptr, plse_ptr, o_ptr, tok, qh, mvalid, dv, dvm, sot, soh,
                                HKV * G, BLOCK_M, BLOCK_DV, SPLITS)
                    tl.atomic_xchg(tk_ptr + b * HKV + kvh, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _merge_tile(po_ptr, plse_ptr, o_ptr, tok, qh, mvalid, dv, dvm, sot, soh, HQ: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS: tl.constexpr):
        """``_merge_kernel``'s arithmetic for one tile of query rows, in split order (reads bypass
        L1: other programs wrote them)."""
        base = (tok * HQ + qh) * SPLITS
        mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for sp in tl.static_range(SPLITS):
            mx = tl.maximum(mx, tl.load(plse_ptr + base + sp, mask=mvalid, other=float("-inf"), cache_modifier=".cg"))
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        tot = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for sp in tl.static_range(SPLITS):
            lse = tl.load(plse_ptr + base + sp, mask=mvalid, other=float("-inf"), cache_modifier=".cg")
            w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - mx))
            tot += w
            part = tl.load(po_ptr + (base + sp)[:, None] * BLOCK_DV + dv[None, :],
                           mask=(mvalid & (lse > float("-inf")))[:, None], other=0.0, cache_modifier=".cg")
            acc += part * w[:, None]
        out = acc / tl.where(tot > 0, tot, 1.0)[:, None]
        tl.store(o_ptr + tok[:, None] * sot + qh[:, None] * soh + dv[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=mvalid[:, None] & dvm[None, :])

    @triton.jit
    def _merge_kernel(po_ptr, plse_ptr, o_ptr, sot, soh, HQ: tl.constexpr, DV: tl.constexpr,
                      BLOCK_DV: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
        gdc_enter(PDL)
        tok = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        sp = tl.arange(0, SPLITS)
        row = (tok * HQ + h) * SPLITS + sp
        lse = tl.load(plse_ptr + row)
        mx = tl.max(lse, axis=0)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - tl.where(mx == float("-inf"), 0.0, mx)))
        tot = tl.sum(w, axis=0)
        dv = tl.arange(0, BLOCK_DV)
        part = tl.load(po_ptr + row[:, None] * BLOCK_DV + dv[None, :], mask=(lse > float("-inf"))[:, None],
                       other=0.0)
        out = tl.sum(part * w[:, None], axis=0) / tl.where(tot > 0, tot, 1.0)
        tl.store(o_ptr + tok * sot + h * soh + dv, out.to(o_ptr.dtype.element_ty), mask=dv < DV)


def decode_blocks(d: int, dv: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) by head size: the K and V tiles must fit in registers
    and SMEM (docs/decisions/attention.md)."""
    big = max(d, dv)
    if big <= 128:
        return 64, 4, 3
    if big <= 256:
        return 32, 4, 2
    return 16, 8, 2


def paged_decode(q, k_cache, v_cache, page_table, slots, kv_lens, q_pos, *, t: int, page_size: int,
                 scale: float, window: int | None = None, softcap: float | None = None, num_splits: int = 1,
                 out: torch.Tensor | None = None, tune: dict | None = None,
                 order: torch.Tensor | None = None, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """q [B*t, Hq, D] (row b owns tokens b*t..b*t+t-1) -> out [B*t, Hq, Dv]. An FP8 cache is read
    with its (k scale, v scale) ``kv_scales`` (``kv_pool.py``).

    ``slots`` [B], ``kv_lens`` [B] and ``q_pos`` [B*t] are device tensors; nothing here reads
    them on the host, so the call is CUDA-graph safe for a fixed B, t and ``num_splits``.
    ``order`` [B] (a permutation of the rows, longest first) sets the launch order.
    ``tune`` overrides the launch shape (block_n, num_warps, num_stages) for benchmark sweeps."""
    n, hq, d = q.shape
    b = slots.shape[0]
    hkv, dv = k_cache.shape[1], v_cache.shape[-1]
    g = hq // hkv
    if out is None:
        out = torch.empty((n, hq, dv), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    block_n, warps, stages = decode_blocks(d, dv)
    if tune:
        block_n, warps, stages = (tune.get("block_n", block_n), tune.get("num_warps", warps),
                                  tune.get("num_stages", stages))
    bdv = next_pow2(dv)
    splits = next_pow2(max(1, num_splits))
    part = lse = tk = page_table  # stand-ins when unused (one split): a whole tensor, fixed alignment
    on = pdl(q)
    fused = splits > 1 and b * hkv <= TICKETS
    if splits > 1:
        part = torch.empty((n, hq, splits, bdv), dtype=torch.float32, device=q.device)
        lse = torch.empty((n, hq, splits), dtype=torch.float32, device=q.device)
    if fused:
        tk = tickets(q.device)
    grid = (hkv, b, splits) if order is not None else (b, hkv, splits)
    _decode_kernel[grid](
        q, k_cache, v_cache, out, part, lse, page_table, slots, kv_lens, q_pos,
        order if order is not None else page_table, tk,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), scale * kv_scales[0], softcap or 0.0, window or 0,
        kv_scales[1], T=t, G=g, HKV=hkv, PAGE=page_size, D=d, DV=dv, BLOCK_D=next_pow2(d), BLOCK_DV=bdv,
        BLOCK_M=max(16, next_pow2(t * g)), BLOCK_N=block_n, SPLITS=splits, USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None, IEEE=q.dtype == torch.float32 or interpreting(), PDL=on,
        ORDERED=order is not None, FUSED_MERGE=fused,
        num_warps=warps, num_stages=stages, launch_pdl=on == PDL_ON,
    )
    if splits > 1 and not fused:
        _merge_kernel[(n, hq)](part, lse, out, out.stride(0), out.stride(1), HQ=hq, DV=dv, BLOCK_DV=bdv,
                               SPLITS=splits, PDL=on, num_warps=4, launch_pdl=on == PDL_ON)
    return out
