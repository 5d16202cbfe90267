"""Per-head q/k norm + rotary embedding + KV store, one (token, group of heads) per program.

For each token t and query head: ``q_out = rope(norm(q))``. For each KV head (when the layer
writes KV): ``k_cache[loc[t]] = rope(norm(k))`` and ``v_cache[loc[t]] = vnorm(v)``. One launch
replaces the norms, the cos/sin build, rotate-half, the two multiplies and the two index copies
of the reference path. Rotation is neox style (rotate-half), as HF's Llama/Qwen/Gemma.

Rounding follows HF: cos/sin are computed in float32 and rounded to the model dtype, and each of
``x * cos``, ``rotate_half(x) * sin`` and their sum is rounded. Norm styles: 0 none, 1 llama
(Qwen3's q/k norm), 2 gemma; ``V_NORM`` is Gemma 4's weightless v norm. Gemma 4's partial
("proportional") rotary needs nothing special: its zero frequencies give cos 1, sin 0.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import PDL_ON, interpreting, next_pow2, pdl
from gpu_worker.kernels.gdc import gdc_enter

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice

    from gpu_worker.kernels.fp8_round import to_e4m3

    # Compiled code multiplies through ``mul.rn`` (below); the interpreter's numpy never fuses.
    _EXACT_MUL = tl.constexpr(not interpreting())
except ImportError:
    triton = None

NORM_NONE, NORM_LLAMA, NORM_GEMMA = 0, 1, 2

if triton is not None:

    @triton.jit
    def _rnd(x, DT: tl.constexpr):
        return x.to(DT).to(tl.float32)

    @triton.jit
    def _head_norm(x1, x2, w_ptr, half, hm, HALF: tl.constexpr, eps, NORM: tl.constexpr, DT: tl.constexpr):
        """x1, x2 [HB, BLOCK_H]: the two halves of HB heads; each head normed over its own D."""
        ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        inv = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))[:, None]
        w1 = tl.load(w_ptr + half, mask=hm, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + half, mask=hm, other=0.0).to(tl.float32)[None, :]
        if NORM == 1:
            return _rnd(_rnd(x1 * inv, DT) * w1, DT), _rnd(_rnd(x2 * inv, DT) * w2, DT)
        return _rnd(x1 * inv * w1, DT), _rnd(x2 * inv * w2, DT)

    @triton.jit
    def _mul(a, b):
        """a * b (float32), never contracted into an add: with FP fusion on, LLVM narrowed
        ``rnd(rnd(x1 * c) + rnd(-x2 * s))`` to a bf16 FMA, dropping the product's rounding (HF
        rounds it), and picked which product to fuse per kernel (rope_store and the fused qkv
        GEMV then disagreed in the last bit on the GPU)."""
        if _EXACT_MUL:
            return libdevice.mul_rn(a, b)
        return a * b

    @triton.jit
    def _rotate(x1, x2, c, s, DT: tl.constexpr):
        o1 = _rnd(_rnd(_mul(x1, c), DT) + _rnd(_mul(-x2, s), DT), DT)
        o2 = _rnd(_rnd(_mul(x2, c), DT) + _rnd(_mul(x1, s), DT), DT)
        return o1, o2

    @triton.jit
    def kv_value(x, inv, cache_ptr):
        """What the pool stores for float32 ``x`` (already rounded to the model dtype): the value
        in the pool's dtype, or for an FP8 pool ``clamp(x * inv)`` rounded to e4m3
        (``kv_pool.py``'s convention)."""
        KT: tl.constexpr = cache_ptr.dtype.element_ty
        if KT == tl.float8e4nv:
            return to_e4m3(x * inv)
        return x.to(KT)

    @triton.jit
    def _rope_store_kernel(
        q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, pos_ptr, loc_ptr, inv_ptr, qw_ptr, kw_ptr,
        sqt, sqh, skt, skh, svt, svh, sot, soh, skn, skch, svn, svch, eps, k_inv, v_inv,
        HQ: tl.constexpr, HKV: tl.constexpr, HB: tl.constexpr, HALF: tl.constexpr, DV: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, NORM: tl.constexpr, V_NORM: tl.constexpr,
        PDL: tl.constexpr,
    ):
        gdc_enter(PDL)
        # Program (t, p): HB heads of token t, query heads for p < cdiv(HQ, HB), else KV heads.
        # cos/sin are computed once per program and shared by its heads.
        t = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1)
        NQ: tl.constexpr = (HQ + HB - 1) // HB
        DT = qo_ptr.dtype.element_ty
        half = tl.arange(0, BLOCK_H)
        hm = half < HALF
        f = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + half, mask=hm, other=0.0)
        c = _rnd(tl.cos(f), DT)[None, :]
        s = _rnd(tl.sin(f), DT)[None, :]
        hb = tl.arange(0, HB)
        if p < NQ:
            h = p * HB + hb
            m = (h < HQ)[:, None] & hm[None, :]
            base = q_ptr + t * sqt + h[:, None] * sqh + half[None, :]
            x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
            if NORM != 0:
                x1, x2 = _head_norm(x1, x2, qw_ptr, half, hm, HALF, eps, NORM, DT)
            o1, o2 = _rotate(x1, x2, c, s, DT)
            out = qo_ptr + t * sot + h[:, None] * soh + half[None, :]
            tl.store(out, o1.to(DT), mask=m)
            tl.store(out + HALF, o2.to(DT), mask=m)
        else:
            kh = (p - NQ) * HB + hb
            km = kh < HKV
            m = km[:, None] & hm[None, :]
            loc = tl.load(loc_ptr + t)
            base = k_ptr + t * skt + kh[:, None] * skh + half[None, :]
            x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
            if NORM != 0:
                x1, x2 = _head_norm(x1, x2, kw_ptr, half, hm, HALF, eps, NORM, DT)
            o1, o2 = _rotate(x1, x2, c, s, DT)
            kdst = kc_ptr + loc * skn + kh[:, None] * skch + half[None, :]
            tl.store(kdst, kv_value(o1, k_inv, kc_ptr), mask=m)
            tl.store(kdst + HALF, kv_value(o2, k_inv, kc_ptr), mask=m)
            dv = tl.arange(0, BLOCK_DV)
            vm = km[:, None] & (dv < DV)[None, :]
            v = tl.load(v_ptr + t * svt + kh[:, None] * svh + dv[None, :], mask=vm, other=0.0).to(tl.float32)
            if V_NORM:
                inv_v = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(v * v, axis=1) / DV + eps))[:, None]
                v = _rnd(v * inv_v, DT)
            tl.store(vc_ptr + loc * svn + kh[:, None] * svch + dv[None, :], kv_value(v, v_inv, vc_ptr), mask=vm)


def heads_per_program(tokens: int, heads: int, cpu: bool = False) -> int:
    """Heads one program handles: on a GPU 1 at decode sizes (most parallelism for few tokens),
    up to 8 from 64 tokens on, where one program per (token, head) makes the kernel launch-grid
    bound (about 5x its bytes' time at 8192 tokens of a 24-head model). On the CPU (Triton's
    interpreter, where a program costs its Python steps whatever its width) up to 8 at every
    size; a head's arithmetic is the same in either grouping."""
    if tokens < 64 and not cpu:
        return 1
    return min(8, 1 << max(0, heads.bit_length() - 1))


def rope_store(q, k, v, positions, inv_freq, out_loc, k_cache, v_cache, *, norm: int = NORM_NONE,
               q_weight=None, k_weight=None, v_norm: bool = False, eps: float = 1e-6,
               heads_per_prog: int | None = None, q_out: torch.Tensor | None = None,
               store_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """q [T, Hq, D] -> rotated (normed) q, contiguous (into ``q_out`` when given: a static buffer
    of the piecewise prefill graphs). With ``out_loc``, also writes the rotated (normed) k and
    the (normed) v of every token into the caches; ``k``/``v`` may be strided views (columns of
    a merged qkv output) and may alias each other (Gemma 4's k_eq_v). An FP8 cache stores k and
    v times ``store_scales`` (``KVPool.store_scales``)."""
    t, hq, d = q.shape
    if q_out is None:
        q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    store = out_loc is not None
    hkv = k.shape[1] if store else 0
    if t == 0:
        return q_out
    dv = v.shape[-1] if store else 1
    dummy = q_out
    hb = heads_per_prog or heads_per_program(t, hq, cpu=q.device.type == "cpu")
    grid = (t, -(-hq // hb) + -(-hkv // hb))
    on = pdl(q)
    _rope_store_kernel[grid](
        q, k if store else dummy, v if store else dummy, q_out,
        k_cache if store else dummy, v_cache if store else dummy, positions,
        out_loc if store else positions, inv_freq,
        q_weight if q_weight is not None else dummy, k_weight if k_weight is not None else dummy,
        q.stride(0), q.stride(1),
        k.stride(0) if store else 0, k.stride(1) if store else 0,
        v.stride(0) if store else 0, v.stride(1) if store else 0,
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0) if store else 0, k_cache.stride(1) if store else 0,
        v_cache.stride(0) if store else 0, v_cache.stride(1) if store else 0, eps, *store_scales,
        HQ=hq, HKV=hkv, HB=hb, HALF=d // 2, DV=dv, BLOCK_H=next_pow2(d // 2), BLOCK_DV=next_pow2(dv),
        NORM=norm, V_NORM=v_norm, PDL=on, num_warps=(1 if d <= 256 else 2) * (1 if hb == 1 else 4),
        launch_pdl=on == PDL_ON,
    )
    return q_out
