"""MoE routing in one launch: router logits [T, E] -> the top-k experts of each token and their
weights, as HF's routers compute them (``models/moe.py: route_reference``); and, for 1-4 tokens,
the router's projection and the routing in one launch (``router_topk``).

One program per token holds its E logits (E <= 1024): float32 softmax, then K rounds of "the
largest probability left, the lowest index among equals" (``torch.topk``'s choice on ties; one
reduction a round, over keys that pack the probability above the index),
then, as the model asks: renormalise over the K chosen (``RENORM``), round to the logits' dtype
(``ROUND``: Qwen3-MoE casts its weights to the model dtype), times a per-expert scale
(``SCALED``: Gemma 4). Writes ids int32 [T, K] and weights float32 [T, K]; no host sync, so
the launch is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import PDL_ON, next_pow2, pdl, tickets
from gpu_worker.kernels.gdc import gdc_enter

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_EXPERTS = 1024  # one program's row of logits

if triton is not None:

    @triton.jit
    def _route_row(x, e, em, row, scale_ptr, ids_ptr, w_ptr, K: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_K: tl.constexpr, RENORM: tl.constexpr, ROUND: tl.constexpr, SCALED: tl.constexpr,
                   DT: tl.constexpr):
        """One token's routing from its logits x [BLOCK_E] (float32, -inf past E)."""
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        # One max per pick: a probability (>= 0, so its float32 bits order as integers) over the
        # complement of its index (the lowest index wins among equals); -1 = taken or padding.
        bits = p.to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.where(em, (bits << 32) | (BLOCK_E - 1 - e).to(tl.int64), -1)
        slots = tl.arange(0, BLOCK_K)
        vals = tl.zeros([BLOCK_K], tl.float32)
        idx = tl.zeros([BLOCK_K], tl.int32)
        for k in tl.static_range(K):
            best = tl.max(key, axis=0)
            pick = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
            vals = tl.where(slots == k, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), vals)
            idx = tl.where(slots == k, pick, idx)
            key = tl.where(e == pick, -1, key)
        km = slots < K
        if RENORM:
            vals = vals / tl.sum(tl.where(km, vals, 0.0), axis=0)
        if ROUND:
            vals = vals.to(DT).to(tl.float32)
        if SCALED:
            vals = vals * tl.load(scale_ptr + idx, mask=km, other=0.0).to(tl.float32)
        tl.store(ids_ptr + row * K + slots, idx, mask=km)
        tl.store(w_ptr + row * K + slots, vals, mask=km)

    @triton.jit
    def _route_kernel(logits_ptr, scale_ptr, ids_ptr, w_ptr, E, s_row, K: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, RENORM: tl.constexpr, ROUND: tl.constexpr, SCALED: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        em = e < E
        x = tl.load(logits_ptr + row * s_row + e, mask=em, other=float("-inf")).to(tl.float32)
        _route_row(x, e, em, row, scale_ptr, ids_ptr, w_ptr, K, BLOCK_E, BLOCK_K, RENORM, ROUND, SCALED,
                   logits_ptr.dtype.element_ty)

    @triton.jit(do_not_specialize=["T"])
    def _router_kernel(x_ptr, w_ptr, logits_ptr, tk_ptr, scale_ptr, ids_ptr, wout_ptr, T, E, H, sx, sw,
                       K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, E_PART: tl.constexpr,
                       BLOCK_H: tl.constexpr, MT: tl.constexpr, RENORM: tl.constexpr, ROUND: tl.constexpr,
                       SCALED: tl.constexpr, PDL: tl.constexpr):
        """Program p: the logits of experts [p*E_PART, (p+1)*E_PART) for the T <= MT tokens (FMA,
        float32 sums, rounded to the model dtype as HF's projection), into ``logits`` [MT, E]; the
        last program to take the ticket routes every token from them (the split-K GEMV's
        pattern, ``gemv_kernels.py``), then puts the ticket back to 0."""
        gdc_enter(PDL)
        DT = x_ptr.dtype.element_ty
        e = tl.program_id(0) * E_PART + tl.arange(0, E_PART)
        em = e < E
        t = tl.arange(0, MT)
        tm = t < T
        acc = tl.zeros([E_PART, MT], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            hm = h < H
            w = tl.load(w_ptr + e.to(tl.int64)[:, None] * sw + h[None, :], mask=em[:, None] & hm[None, :], other=0.0)
            x = tl.load(x_ptr + t.to(tl.int64)[:, None] * sx + h[None, :], mask=tm[:, None] & hm[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
        tl.store(logits_ptr + t[None, :] * E + e[:, None], acc.to(DT).to(tl.float32), mask=em[:, None] & tm[None, :])
        tl.debug_barrier()  # every thread's logits before the ticket, which releases them
        if tl.atomic_add(tk_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            ea = tl.arange(0, BLOCK_E)
            for row in range(0, T):
                lg = tl.load(logits_ptr + row * E + ea, mask=ea < E, other=float("-inf"), cache_modifier=".cg")
                _route_row(lg, ea, ea < E, row, scale_ptr, ids_ptr, wout_ptr, K, BLOCK_E, BLOCK_K, RENORM, ROUND,
                           SCALED, DT)
            tl.atomic_xchg(tk_ptr, 0, sem="relaxed", scope="gpu")


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool, expert_scale: torch.Tensor | None = None,
               round_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit column stride) -> (ids [T, top_k] int32, weights [T, top_k] float32).
    The engine routes 1-4 tokens with ``router_topk``, so this runs in forwards of more tokens,
    which launch without PDL (``kernels/__init__.py``)."""
    t, e = logits.shape
    if e > MAX_EXPERTS:
        raise ValueError(f"num_experts {e} is more than the routing kernel takes ({MAX_EXPERTS})")
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t:
        _route_kernel[(t,)](
            logits, expert_scale if expert_scale is not None else weights, ids, weights, e, logits.stride(0),
            K=top_k, BLOCK_E=next_pow2(e), BLOCK_K=next_pow2(top_k), RENORM=renormalize, ROUND=round_weights,
            SCALED=expert_scale is not None, num_warps=4 if e > 256 else 1,
        )
    return ids, weights


ROUTER_MAX_TOKENS = 4  # the fused router's token rows (decode; MTP's verify and draft at one request)
# A program of the fused router scores E_PART experts over BLOCK_H columns at a time: 128
# programs at 128 experts, each a few wide loads (a long loop of small ones is latency-bound).
E_PART = 1
ROUTER_BLOCK_H = 1024


def router_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                expert_scale: torch.Tensor | None = None, round_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_topk(x @ weight^T, ...)`` in one launch for 1..ROUTER_MAX_TOKENS tokens: x [T, H],
    weight [E, H] (unit column strides). Takes the device's ticket 0 (``kernels/__init__.py``)."""
    t, h = x.shape
    e = weight.shape[0]
    if not 1 <= t <= ROUTER_MAX_TOKENS or e > MAX_EXPERTS:
        raise ValueError(f"the fused router takes 1-{ROUTER_MAX_TOKENS} tokens and <= {MAX_EXPERTS} experts")
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    logits = torch.empty((ROUTER_MAX_TOKENS, e), dtype=torch.float32, device=x.device)
    on = pdl(x)
    _router_kernel[(triton.cdiv(e, E_PART),)](
        x, weight, logits, tickets(x.device), expert_scale if expert_scale is not None else weights, ids, weights, t,
        e, h, x.stride(0), weight.stride(0), K=top_k, BLOCK_E=next_pow2(e), BLOCK_K=next_pow2(top_k), E_PART=E_PART,
        BLOCK_H=min(ROUTER_BLOCK_H, next_pow2(h)), MT=ROUTER_MAX_TOKENS, RENORM=renormalize, ROUND=round_weights,
        SCALED=expert_scale is not None, PDL=on, num_warps=4, launch_pdl=on == PDL_ON,
    )
    return ids, weights
