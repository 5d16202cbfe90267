"""Gated activation ``act(gate) * up`` in one pass (the MLP's middle), rounding like HF:
``act(gate)`` is rounded to the model dtype before the product, and the product again.

``gate`` and ``up`` may be two column halves of one merged ``gate_up`` output (strided rows).
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

ACTS = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2}

if triton is not None:

    @triton.jit
    def act_fn(g, ACT: tl.constexpr):
        """act(g) in float32 (silu / erf gelu / tanh gelu), before any rounding."""
        if ACT == 0:
            a = g / (1.0 + tl.exp(-g))
        elif ACT == 1:
            a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        else:
            inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
        return a

    @triton.jit
    def gated_value(g, u, ACT: tl.constexpr, DT: tl.constexpr):
        """HF's ``act(gate) * up`` in the model dtype (float32 in, rounded to DT, as float32):
        act rounded, then the product rounded."""
        return (act_fn(g, ACT).to(DT).to(tl.float32) * u).to(DT).to(tl.float32)

    @triton.jit
    def _gated_act_kernel(g_ptr, u_ptr, o_ptr, n_cols, sg, su, so, ACT: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
        gdc_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        DT = o_ptr.dtype.element_ty
        g = tl.load(g_ptr + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + row * so + cols, gated_value(g, u, ACT, DT).to(DT), mask=mask)


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """gate, up [T, I] (unit column stride) -> act(gate) * up [T, I]."""
    t, n = gate.shape
    out = torch.empty((t, n), dtype=gate.dtype, device=gate.device)
    if t:
        block, on = min(4096, next_pow2(n)), pdl(gate)
        _gated_act_kernel[(t, triton.cdiv(n, block))](
            gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0), ACT=ACTS[act], BLOCK=block,
            PDL=on, num_warps=4, launch_pdl=on == PDL_ON,
        )
    return out
