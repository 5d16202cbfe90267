"""Final-logit softcapping in one pass: ``tanh(float(x) / cap) * cap``, float32 out.

Gemma's LM head returns model-dtype logits; torch's float copy, divide, tanh and multiply are four
launches over [rows, vocab] on every decode step, each a pass over a 262k vocabulary. The kernel does torch's
float32 operations in its order: the division as torch's CUDA kernel does it for a scalar
divisor, a multiply by the float32 reciprocal (``div_true_kernel_cuda``), then libdevice's
``tanh`` (torch calls the CUDA toolkit's ``tanhf``; the GPU test allows 2 ulp there), then the
multiply by ``cap``. Triton's interpreter has no libdevice: there (CI) tanh is written with
``exp``, within 1e-5 of torch's for a cap of 30.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.kernels import interpreting, use_triton

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: the torch path below
    triton = None

BLOCK = 4096

if triton is not None:

    # The decode rows' logits may be a view past the prefill rows': no alignment specialisation.
    @triton.jit(do_not_specialize_on_alignment=["x_ptr"])
    def _softcap_kernel(x_ptr, out_ptr, V, sx, so, inv_cap, cap, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < V
        x = tl.load(x_ptr + r * sx + offs, mask=m, other=0.0).to(tl.float32)
        z = x * inv_cap  # torch's x / cap for a scalar cap on CUDA
        if LIBDEVICE:
            t = libdevice.tanh(z)
        else:
            e = tl.exp(-2.0 * tl.abs(z))  # <= 1: no overflow
            t = (1.0 - e) / (1.0 + e)
            t = tl.where(z < 0, -t, t)
        y = t * cap
        tl.store(out_ptr + r * so + offs, y, mask=m)


def softcap_reference(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits.float() / cap) * cap


def softcap_float(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """logits [R, V] (any float dtype) -> float32 ``tanh(logits / cap) * cap``; no cap: the float
    copy alone. One kernel where Triton runs the tensor, torch's ops elsewhere."""
    if cap is None:
        return logits.float()
    if not use_triton(logits) or logits.dim() != 2 or logits.stride(1) != 1:
        return softcap_reference(logits, cap)
    r, v = logits.shape
    out = torch.empty((r, v), dtype=torch.float32, device=logits.device)
    if r and v:
        inv = float(np.float32(1.0) / np.float32(cap))  # as torch: 1 / float(cap), in float32
        _softcap_kernel[(r, triton.cdiv(v, BLOCK))](logits, out, v, logits.stride(0), out.stride(0), inv, float(cap),
                                                   LIBDEVICE=not interpreting(), BLOCK=BLOCK, num_warps=8)
    return out
