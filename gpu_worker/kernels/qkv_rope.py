"""The one-row qkv projection with RoPE and the KV store in its epilogue (Llama-style layers).

At one decode row the qkv projection is the FMA GEMV (``kernels/gemv.py``) and RoPE + the KV
store a separate 2 us launch (``kernels/rope.py``) that re-reads the qkv output. Here each
program streams ``PAIRS`` weight rows from the first half of one head and the matching rows
``+ D / 2`` of the second half (gathered rows: no weight re-layout), so it holds both halves of
the rotate-half pairs it owns and can finish them in registers:

- a query head's pairs are rotated and written to ``q_out`` [Hq, D];
- a key head's pairs are rotated and written to the pool's key slot ``out_loc[0]``;
- a value head's rows go to the pool's value slot unrotated.

Same sums as the plain GEMV with ``block_n = 2 * PAIRS`` (same K tiles, same reduction), rounded
to the model dtype, then ``rope.py``'s roundings (cos / sin from float32, each product and the
sum rounded, as HF): bitwise the unfused pair. Only where that pair would run: one row, no
qkv bias, no per-head q/k norm, one K split (the dispatch is ``applies``). An FP8 qkv weight
streams its rows through the one-row FP8 GEMV's loop (``fp8_gemv.fp8_row_sums``, its tile of
``ROW_CONFIG``): bitwise that GEMV + ``rope_store`` pair.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import PDL_ON, pdl
from gpu_worker.kernels.gdc import gdc_enter, prefetch_l2
from gpu_worker.kernels import use_triton
from gpu_worker.kernels.fp8_gemv import ROW_CONFIG, row_splits
from gpu_worker.kernels.fp8_round import FP8
from gpu_worker.kernels.gemv import CONFIG, SKINNY_MAX_K, launch_config, launch_tiles, prefetch_cols, short_k_splits, skinny

try:
    import triton
    import triton.language as tl

    from gpu_worker.kernels.fp8_gemv import fp8_row_sums
    from gpu_worker.kernels.gemv_kernels import _dot_row
    from gpu_worker.kernels.rope import _rnd, _rotate, kv_value
except ImportError:
    triton = None


def applies(x: torch.Tensor, w: torch.Tensor, head_dim: int) -> bool:
    """Whether the one-row qkv GEMV (FMA kernel, one K split; for FP8 weights the one-row FP8
    kernel) would run for ``x`` through ``w``, and ``head_dim`` splits into whole program tiles."""
    pairs = _pairs(w)
    if not (x.dim() == 2 and x.shape[0] == 1 and w.shape[1] <= SKINNY_MAX_K and head_dim % 2 == 0
            and (head_dim // 2) % pairs == 0):
        return False
    if w.dtype == FP8:
        return (use_triton(x) and x.stride(1) == 1 and w.is_contiguous()
                and row_splits(w.shape[0], w.shape[1], ROW_CONFIG, x.device) == 1)
    return (skinny(x, w) and launch_config(1, w) is CONFIG
            and short_k_splits(launch_tiles(w.shape[0], CONFIG), w.shape[1], CONFIG["block_k"], x.device) == 1)


def _pairs(w: torch.Tensor) -> int:
    """Rotate-half pairs a program owns: half the rows of the GEMV tile it replaces."""
    return (ROW_CONFIG if w.dtype == FP8 else CONFIG)["block_n"] // 2


if triton is not None:

    @triton.jit
    def _qkv_rope_kernel(x_ptr, w_ptr, s_ptr, xs_ptr, qo_ptr, kc_ptr, vc_ptr, pos_ptr, loc_ptr, inv_ptr, K, swn, ss,
                         skn, skh, svn, svh, k_inv, v_inv, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                         PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
                         WS: tl.constexpr, A8: tl.constexpr, SN: tl.constexpr, G: tl.constexpr):
        HALF: tl.constexpr = D // 2
        PER_HEAD: tl.constexpr = HALF // PAIRS  # programs per head
        pid = tl.program_id(0)
        head = pid // PER_HEAD
        j = (pid % PER_HEAD) * PAIRS + tl.arange(0, PAIRS)  # this program's pairs: columns j, j + HALF
        i = tl.arange(0, 2 * PAIRS)
        rows = head * D + (pid % PER_HEAD) * PAIRS + (i % PAIRS) + (i // PAIRS) * HALF
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * swn
        if PREFETCH_K > 0:  # as the GEMV: weights only, before the wait
            prefetch_l2(w_rows + tl.minimum(tl.arange(0, PREFETCH_K // 16) * 16, K - 1)[None, :], PDL)
        gdc_enter(PDL)
        # the epilogue's operands, loaded before the weight stream so their latency hides in it
        f = tl.load(pos_ptr).to(tl.float32) * tl.load(inv_ptr + j)
        loc = tl.load(loc_ptr)
        if WS > 0:  # FP8: the one-row FP8 GEMV's loop (G scale groups a K tile)
            acc = fp8_row_sums(w_ptr + rows.to(tl.int64) * swn, (rows // SN) * ss, s_ptr, x_ptr, xs_ptr, 0, K,
                               rows >= 0, 2 * PAIRS, G, WS, A8)
        else:
            k0 = tl.arange(0, BLOCK_K)
            acc = tl.zeros([2 * PAIRS], tl.float32)
            for start in range(0, K, BLOCK_K):
                k = start + k0
                km = k < K
                w = tl.load(w_rows + k[None, :], mask=km[None, :], other=0.0).to(tl.float32)
                acc += _dot_row(w, x_ptr, k, km)
        DT = qo_ptr.dtype.element_ty
        x1, x2 = tl.split(tl.permute(tl.reshape(_rnd(acc, DT), [2, PAIRS]), [1, 0]))
        if head < HQ + HKV:
            o1, o2 = _rotate(x1, x2, _rnd(tl.cos(f), DT), _rnd(tl.sin(f), DT), DT)
            if head < HQ:
                qdst = qo_ptr + head * D + j
                tl.store(qdst, o1.to(DT))
                tl.store(qdst + HALF, o2.to(DT))
            else:  # the pool's dtype may differ from q's (FP8 KV): a pointer of its own
                kdst = kc_ptr + loc * skn + (head - HQ) * skh + j
                tl.store(kdst, kv_value(o1, k_inv, kc_ptr))
                tl.store(kdst + HALF, kv_value(o2, k_inv, kc_ptr))
        else:
            vdst = vc_ptr + loc * svn + (head - HQ - HKV) * svh + j
            tl.store(vdst, kv_value(x1, v_inv, vc_ptr))
            tl.store(vdst + HALF, kv_value(x2, v_inv, vc_ptr))


def qkv_rope_store(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                   out_loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int, q_out: torch.Tensor | None = None,
                   store_scales: tuple[float, float] = (1.0, 1.0), scale: torch.Tensor | None = None,
                   scale_rows: int = 1, a8: int = 0, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] through the merged qkv weight w [(Hq + 2 Hkv) D, K] -> rotated q [1, Hq, D]
    (into ``q_out`` when given); the rotated k and the v of the row go to the caches
    ([slots, Hkv, D], unit last stride) at ``out_loc[0]`` (an FP8 cache: times ``store_scales``,
    as ``rope.rope_store``). An FP8 ``w`` comes with ``scale`` / ``scale_rows`` / ``a8`` /
    ``input_scale`` as ``gemv.gemv`` takes them. Callers check ``applies`` first."""
    assert w.shape[0] == (num_heads + 2 * num_kv_heads) * head_dim and x.shape[0] == 1, (x.shape, w.shape)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and v_cache.shape[-1] == head_dim
    if q_out is None:
        q_out = torch.empty((1, num_heads, head_dim), dtype=x.dtype, device=x.device)
    assert q_out.is_contiguous()
    pairs = _pairs(w)
    cfg = ROW_CONFIG if scale is not None else CONFIG
    on = pdl(x)
    grid = ((num_heads + 2 * num_kv_heads) * (head_dim // 2 // pairs),)
    s = scale if scale is not None else q_out  # stand-ins: never read by a bf16 launch
    fp8 = dict(WS=0 if scale is None else (1 if scale.shape[1] == 1 else 2), A8=a8, SN=scale_rows)
    _qkv_rope_kernel[grid](
        x, w, s, input_scale if input_scale is not None else s, q_out, k_cache, v_cache, positions, out_loc,
        inv_freq, x.shape[1], w.stride(0), scale.stride(0) if scale is not None else 0,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), *store_scales,
        HQ=num_heads, HKV=num_kv_heads, D=head_dim, PAIRS=pairs, BLOCK_K=CONFIG["block_k"],
        PDL=on, PREFETCH_K=prefetch_cols(w.shape[0], 1, x.shape[1], elt=w.element_size()) if on == PDL_ON else 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=on == PDL_ON,
        G=ROW_CONFIG["groups"], **fp8,
    )
    return q_out
