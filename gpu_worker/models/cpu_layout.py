"""Projection weights laid out for the CPU's few-row GEMMs.

A decode step multiplies 1 to T*B rows by every weight. MKL's kernels for ``x @ W^T`` with ``W``
stored [out, in] row-major (``F.linear``'s layout) cost almost twice as much at 4 to 8 rows as
with ``W^T`` stored contiguous (``docs/decisions/cpu.md``, "Weight layout"). So on the CPU each
projection weight (and a tied embedding that serves as the LM head) is stored column-major: the
same [out, in] tensor, strides (1, out). That is MKL's float32 kernels' preference: bfloat16
weights (the draft's, ``gpu_worker/main.py: draft_dtype``) keep the row-major layout, which
oneDNN's bf16 GEMMs run about as fast, and which torch's own one-row bf16 GEMV needs (~4x slower
on column-major weights; ``docs/decisions/cpu.md``, "Draft dtype").
Every reader sees the same values; ``F.linear`` then runs the fast layout, eager or compiled.
Call before anything holds the weights' storage (the compiled steps bind them at load).
"""

from __future__ import annotations

import torch
from torch import nn


_LAID_OUT = (torch.float32,)  # MKL's dtype; see the module docstring


def _column_major(p: torch.Tensor) -> None:
    if p.dim() == 2 and p.dtype in _LAID_OUT and p.stride() != (1, p.shape[0]):
        p.data = p.data.t().contiguous().t()


def column_major_projections(model: nn.Module) -> None:
    """Every float32 ``nn.Linear`` weight of ``model`` (an FP8 projection keeps its own layout)
    and its LM head's weight, column-major (in place)."""
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Linear) and getattr(mod, "quant", None) is None:
                _column_major(mod.weight)
        head = getattr(model, "lm_head_weight", None)
        if head is not None:
            _column_major(head())
