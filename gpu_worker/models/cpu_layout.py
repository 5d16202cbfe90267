"""Projection weights laid out for the CPU's few-row GEMMs.

A decode step multiplies 1 to T*B rows by every weight. MKL's kernels for ``x @ W^T`` with ``W``
stored [out, in] row-major (``F.linear``'s layout) cost almost twice as much at 4 to 8 rows as
with ``W^T`` stored contiguous (``docs/decisions/cpu.md``, "Weight layout"). So on the CPU each
projection weight (and a tied embedding that serves as the LM head) is stored column-major: the
same [out, in] tensor, strides (1, out). The compiled steps' own few-row GEMM
(``graphs/cpu_gemm.cpp``) streams that layout, float32 (the target) and bfloat16 (the draft,
``gpu_worker/main.py: draft_dtype``) alike; oneDNN's bf16 GEMMs (the draft past 4 rows) run either
layout within ~15 %. Eager one-row bf16 GEMMs (torch's GEMV: the draft with the compiled steps
off) are ~4x slower on it (``docs/decisions/cpu.md``, "Draft dtype").
Every reader sees the same values; ``F.linear`` then runs the fast layout, eager or compiled.
Call before anything holds the weights' storage (the compiled steps bind them at load).
"""

from __future__ import annotations

import torch
from torch import nn


_LAID_OUT = (torch.float32, torch.bfloat16)  # see the module docstring


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
