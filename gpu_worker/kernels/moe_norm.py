"""The row kernels around the experts: the sum over slots, and Gemma 4's MoE norms, each
rounding where HF rounds (``norm.py``'s row helpers).

- ``moe_sum``: pairs [T*K, H] -> out [T, H], the K slots of a token summed in float32 in slot
  order, rounded once;
- ``gemma_moe_inputs`` (Gemma 4): the residual stream x -> the router's input
  ``norm(x) * scale * 1/sqrt(H)`` (a weightless norm, then two products, each rounded) and the
  experts' input ``pre_feedforward_layernorm_2(x)``, one read of x;
- ``gemma_moe_combine`` (Gemma 4): ``post_feedforward_layernorm_1(dense) +
  post_feedforward_layernorm_2(moe)``, both norms and the sum rounded as HF;
- ``moe_sum_add_norm`` (Qwen3-MoE, one rank): the next residual add and norm over the sum of
  the slots (``norm.py``'s MODE_ADD_NORM, Llama rounding), the slot sum's own kernel saved;
- ``gemma_moe_tail`` (Gemma 4 without PLE, one rank): the layer's end in one kernel: the slots'
  sum, the combine above, then the residual add of ``post_feedforward_layernorm``, the layer
  scalar and the next layer's input norm (``norm.py``'s MODE_NORM_ADD), three kernels' work.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import PDL_ON, next_pow2, pdl
from gpu_worker.kernels.gdc import gdc_enter

try:
    import triton
    import triton.language as tl

    from gpu_worker.kernels.norm import _norm_row, _rnd
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _moe_sum_kernel(pairs_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        gdc_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        acc = tl.zeros([BLOCK_H], tl.float32)
        for k in tl.static_range(TOP_K):
            acc += tl.load(pairs_ptr + (t * TOP_K + k) * H + h, mask=hm, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=hm)

    @triton.jit
    def _gemma_inputs_kernel(x_ptr, scale_ptr, w2_ptr, r_ptr, e_ptr, H, sx, eps, root, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        gdc_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < H
        DT = r_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
        r = _norm_row(x, scale_ptr, cols, m, H, eps, False, True, DT)
        r = _rnd(r * tl.load(scale_ptr + cols, mask=m, other=0.0).to(tl.float32), DT)
        r = _rnd(r * root, DT)
        tl.store(r_ptr + row * H + cols, r.to(DT), mask=m)
        e = _norm_row(x, w2_ptr, cols, m, H, eps, True, True, DT)
        tl.store(e_ptr + row * H + cols, e.to(DT), mask=m)

    @triton.jit
    def _gemma_combine_kernel(d_ptr, m_ptr, w1_ptr, w2_ptr, out_ptr, H, sd, eps, BLOCK: tl.constexpr,
                              PDL: tl.constexpr):
        gdc_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        msk = cols < H
        DT = out_ptr.dtype.element_ty
        d = tl.load(d_ptr + row * sd + cols, mask=msk, other=0.0).to(tl.float32)
        a = _norm_row(d, w1_ptr, cols, msk, H, eps, True, True, DT)
        mo = tl.load(m_ptr + row * H + cols, mask=msk, other=0.0).to(tl.float32)
        b = _norm_row(mo, w2_ptr, cols, msk, H, eps, True, True, DT)
        tl.store(out_ptr + row * H + cols, (a + b).to(DT), mask=msk)

    @triton.jit
    def _gemma_tail_kernel(d_ptr, p_ptr, x_ptr, w1_ptr, w2_ptr, wp_ptr, wn_ptr, s_ptr, out_ptr, H, sd, sx, eps,
                           TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        gdc_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < H
        DT = out_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK], tl.float32)
        for k in tl.static_range(TOP_K):
            acc += tl.load(p_ptr + (row * TOP_K + k) * H + cols, mask=m, other=0.0).to(tl.float32)
        moe = _norm_row(_rnd(acc, DT), w2_ptr, cols, m, H, eps, True, True, DT)
        d = tl.load(d_ptr + row * sd + cols, mask=m, other=0.0).to(tl.float32)
        h = _rnd(_norm_row(d, w1_ptr, cols, m, H, eps, True, True, DT) + moe, DT)
        x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
        r = _rnd(x + _norm_row(h, wp_ptr, cols, m, H, eps, True, True, DT), DT)
        r = _rnd(r * tl.load(s_ptr).to(tl.float32), DT)
        tl.store(x_ptr + row * sx + cols, r.to(DT), mask=m)
        tl.store(out_ptr + row * H + cols, _norm_row(r, wn_ptr, cols, m, H, eps, True, True, DT).to(DT), mask=m)


if triton is not None:

    @triton.jit
    def _sum_add_norm_kernel(p_ptr, r_ptr, w_ptr, out_ptr, H, sr, eps, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        gdc_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < H
        DT = out_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK], tl.float32)
        for k in tl.static_range(TOP_K):
            acc += tl.load(p_ptr + (row * TOP_K + k) * H + cols, mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * sr + cols, mask=m, other=0.0).to(tl.float32)
        r = _rnd(_rnd(acc, DT) + r, DT)
        tl.store(r_ptr + row * sr + cols, r.to(DT), mask=m)
        tl.store(out_ptr + row * H + cols, _norm_row(r, w_ptr, cols, m, H, eps, True, False, DT).to(DT), mask=m)


def moe_sum(pairs: torch.Tensor, top_k: int) -> torch.Tensor:
    """pairs [T*K, H] (contiguous) -> [T, H]: each token's K slots summed (float32, slot order)."""
    n, h = pairs.shape
    t = n // top_k
    out = torch.empty((t, h), dtype=pairs.dtype, device=pairs.device)
    if t:
        block = min(1024, next_pow2(h))
        on = pdl(out)
        _moe_sum_kernel[(t, triton.cdiv(h, block))](pairs, out, h, TOP_K=top_k, BLOCK_H=block, PDL=on, num_warps=4,
                                                    launch_pdl=on == PDL_ON)
    return out


def gemma_moe_inputs(x: torch.Tensor, scale: torch.Tensor, pre_norm2: torch.Tensor, eps: float,
                     root: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (the residual stream) -> (router input, experts' input), both [T, H]."""
    t, h = x.shape
    r, e = torch.empty_like(x), torch.empty_like(x)
    if t:
        on = pdl(x)
        _gemma_inputs_kernel[(t,)](x, scale, pre_norm2, r, e, h, x.stride(0), eps, root, BLOCK=next_pow2(h), PDL=on,
                                   num_warps=4 if h <= 4096 else 8, launch_pdl=on == PDL_ON)
    return r, e


def gemma_moe_combine(dense: torch.Tensor, moe: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      eps: float) -> torch.Tensor:
    """norm_w1(dense) + norm_w2(moe) [T, H] (Gemma norms, rounded as HF)."""
    t, h = dense.shape
    out = torch.empty((t, h), dtype=dense.dtype, device=dense.device)
    if t:
        on = pdl(dense)
        _gemma_combine_kernel[(t,)](dense, moe.contiguous(), w1, w2, out, h, dense.stride(0), eps, BLOCK=next_pow2(h),
                                    PDL=on, num_warps=4 if h <= 4096 else 8, launch_pdl=on == PDL_ON)
    return out


def gemma_moe_tail(dense: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   w_post: torch.Tensor, w_next: torch.Tensor, scale: torch.Tensor, eps: float,
                   top_k: int) -> torch.Tensor:
    """A Gemma 4 MoE layer's end (module docstring): x <- (x + post(norm1(dense) + norm2(sum of
    the slots))) * scale, in place; returns next_norm(x). ``slots`` [T*K, H] contiguous."""
    t, h = x.shape
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t:
        on = pdl(x)
        _gemma_tail_kernel[(t,)](dense, slots, x, w1, w2, w_post, w_next, scale, out, h, dense.stride(0), x.stride(0),
                                 eps, TOP_K=top_k, BLOCK=next_pow2(h), PDL=on, num_warps=4 if h <= 4096 else 8,
                                 launch_pdl=on == PDL_ON)
    return out


def moe_sum_add_norm(slots: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                     top_k: int) -> torch.Tensor:
    """residual <- residual + (sum of each token's ``top_k`` slots, rounded), in place; returns the
    Llama-style RMSNorm of it with weight ``w``. ``slots`` [T*K, H] contiguous."""
    t, h = residual.shape
    out = torch.empty((t, h), dtype=residual.dtype, device=residual.device)
    if t:
        on = pdl(residual)
        _sum_add_norm_kernel[(t,)](slots, residual, w, out, h, residual.stride(0), eps, TOP_K=top_k,
                                   BLOCK=next_pow2(h), PDL=on, num_warps=4 if h <= 4096 else 8,
                                   launch_pdl=on == PDL_ON)
    return out
