"""MoE routing in one launch: router logits [T, E] -> the top-k experts of each token and their
weights, as HF's routers compute them (``models/moe.py: route_reference``).

One program per token holds its E logits (E <= 1024): float32 softmax, then K rounds of "the
largest probability left, the lowest index among equals" (``torch.topk``'s choice on ties),
then, as the model asks: renormalise over the K chosen (``RENORM``), round to the logits' dtype
(``ROUND``: Qwen3-MoE casts its weights to the model dtype), times a per-expert scale
(``SCALED``: Gemma 4). Writes ids int32 [T, K] and weights float32 [T, K]; no host sync, so
the launch is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import PDL_ON, next_pow2, pdl
from gpu_worker.kernels.gdc import gdc_enter

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_EXPERTS = 1024  # one program's row of logits

if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, scale_ptr, ids_ptr, w_ptr, E, s_row, K: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, RENORM: tl.constexpr, ROUND: tl.constexpr, SCALED: tl.constexpr,
                      PDL: tl.constexpr):
        gdc_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        em = e < E
        x = tl.load(logits_ptr + row * s_row + e, mask=em, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        left = tl.where(em, p, -1.0)  # probabilities still to choose from; -1 = taken or padding
        slots = tl.arange(0, BLOCK_K)
        vals = tl.zeros([BLOCK_K], tl.float32)
        idx = tl.zeros([BLOCK_K], tl.int32)
        for k in tl.static_range(K):
            best = tl.max(left, axis=0)
            pick = tl.min(tl.where(left == best, e, BLOCK_E), axis=0)
            vals = tl.where(slots == k, best, vals)
            idx = tl.where(slots == k, pick, idx)
            left = tl.where(e == pick, -1.0, left)
        km = slots < K
        if RENORM:
            vals = vals / tl.sum(tl.where(km, vals, 0.0), axis=0)
        if ROUND:
            vals = vals.to(logits_ptr.dtype.element_ty).to(tl.float32)
        if SCALED:
            vals = vals * tl.load(scale_ptr + idx, mask=km, other=0.0).to(tl.float32)
        tl.store(ids_ptr + row * K + slots, idx, mask=km)
        tl.store(w_ptr + row * K + slots, vals, mask=km)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool, expert_scale: torch.Tensor | None = None,
               round_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit column stride) -> (ids [T, top_k] int32, weights [T, top_k] float32)."""
    t, e = logits.shape
    if e > MAX_EXPERTS:
        raise ValueError(f"num_experts {e} is more than the routing kernel takes ({MAX_EXPERTS})")
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t:
        on = pdl(logits)
        _route_kernel[(t,)](
            logits, expert_scale if expert_scale is not None else weights, ids, weights, e, logits.stride(0),
            K=top_k, BLOCK_E=next_pow2(e), BLOCK_K=next_pow2(top_k), RENORM=renormalize, ROUND=round_weights,
            SCALED=expert_scale is not None, PDL=on, num_warps=4 if e > 256 else 1, launch_pdl=on == PDL_ON,
        )
    return ids, weights
