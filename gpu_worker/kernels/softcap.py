"""Final-logit softcapping in one pass: ``tanh(float(x) / cap) * cap``, float32 out.

Gemma's LM head returns model-dtype logits; torch's float copy, divide, tanh and multiply are four
launches over [rows, vocab] (~11 us at four rows of a 262k vocabulary on the H200, the Gemma-4
9B MTP trace in BENCHMARKS.md 2026-12-04 late), on every decode step. The kernel does the same
float32 operations in the same order with correctly rounded division and libdevice's ``tanh``
(the function torch's CUDA kernel calls), so its result is torch's. Triton's interpreter has no
libdevice: there (CI) tanh is written with ``exp``, within 1e-5 of torch's for a cap of 30.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import fused_glue, interpreting, use_triton

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
    def _softcap_kernel(x_ptr, out_ptr, V, sx, so, cap, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < V
        x = tl.load(x_ptr + r * sx + offs, mask=m, other=0.0).to(tl.float32)
        z = tl.math.div_rn(x, cap)  # ``/`` would compile to the approximate div.full.f32
        if LIBDEVICE:
            t = libdevice.tanh(z)
        else:
            t = 2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0
        y = t * cap
        tl.store(out_ptr + r * so + offs, y, mask=m)


def softcap_reference(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits.float() / cap) * cap


def softcap_float(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """logits [R, V] (any float dtype) -> float32 ``tanh(logits / cap) * cap``; no cap: the float
    copy alone. One kernel where Triton runs the tensor and ``TANDEM_FUSED_GLUE=1``
    (``kernels.fused_glue``), torch's ops elsewhere."""
    if cap is None:
        return logits.float()
    if not fused_glue() or not use_triton(logits) or logits.dim() != 2 or logits.stride(1) != 1:
        return softcap_reference(logits, cap)
    r, v = logits.shape
    out = torch.empty((r, v), dtype=torch.float32, device=logits.device)
    if r and v:
        _softcap_kernel[(r, triton.cdiv(v, BLOCK))](logits, out, v, logits.stride(0), out.stride(0), float(cap),
                                                   LIBDEVICE=not interpreting(), BLOCK=BLOCK, num_warps=8)
    return out
