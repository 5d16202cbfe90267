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

Where the CPU has AMX-BF16 and the compiled steps run, the projections take the AMX layout
instead (``amx_projections``): bfloat16, row-major, read by ``graphs/cpu_amx.cpp`` at every row
count; a float32 model's weights take it only where every one is exactly a bfloat16 value (a
bfloat16 checkpoint), so its products stay float32-accurate (``docs/decisions/cpu.md``, "AMX").
Such a model's linears then see a float32 x and a bfloat16 weight: ``parallel/linear.py`` and
the embeddings handle the mixed dtypes.
Call before anything holds the weights' storage (the compiled steps bind them at load).
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import nn

from gpu_worker.parallel.linear import Linear


_LAID_OUT = (torch.float32, torch.bfloat16)  # see the module docstring


def _column_major(p: torch.Tensor) -> None:
    if p.dim() == 2 and p.dtype in _LAID_OUT and p.stride() != (1, p.shape[0]):
        p.data = p.data.t().contiguous().t()


def _weights(model: nn.Module, kind: type = nn.Linear) -> list[torch.Tensor]:
    """Every ``kind`` module's weight in ``model`` (an FP8 projection keeps its own) and its LM
    head's."""
    out = [mod.weight for mod in model.modules() if isinstance(mod, kind) and getattr(mod, "quant", None) is None]
    head = getattr(model, "lm_head_weight", None)
    if head is not None and all(head() is not w for w in out):
        out.append(head())
    return out


def _projections(model: nn.Module) -> list[torch.Tensor]:
    """Every ``nn.Linear`` weight of ``model`` and its LM head's."""
    return _weights(model)


def _mixed_ok(model: nn.Module) -> list[torch.Tensor]:
    """The projection weights whose readers take a bfloat16 weight under a float32 x: ``Linear``'s
    (``parallel/linear.py``) and the LM head (``parallel/layers.py: lm_logits``)."""
    return _weights(model, Linear)


def column_major_projections(model: nn.Module) -> None:
    """Every float32 ``nn.Linear`` weight of ``model`` (an FP8 projection keeps its own layout)
    and its LM head's weight, column-major (in place)."""
    with torch.no_grad():
        for w in _projections(model):
            _column_major(w)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere, or where unreadable)."""
    if not sys.platform.startswith("linux"):
        return set()
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


def native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX512-BF16's dot products; AMX-BF16
    implies them). Without them oneDNN's bfloat16 GEMMs widen every operand in software."""
    return "avx512_bf16" in cpu_flags()


def amx_usable() -> bool:
    """Whether this process may run AMX-BF16 tiles: the CPU has them (and AVX512-BF16, which the
    kernel's packing uses) and Linux grants the tile state (``ARCH_REQ_XCOMP_PERM``)."""
    if not {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return False


def bf16_exact(model: nn.Module) -> bool:
    """Whether every weight ``amx_projections`` would convert is exactly a bfloat16 value."""
    with torch.no_grad():
        return all(w.dtype != torch.float32 or torch.equal(w, w.bfloat16().float()) for w in _mixed_ok(model))


def amx_projections(model: nn.Module) -> None:
    """The AMX layout, in place: each projection weight whose readers take mixed dtypes
    (``bf16_exact``), and every bfloat16 one, as a contiguous bfloat16 [out, in] tensor (its old
    storage dropped, not kept beside it); any other float32 one column-major."""
    with torch.no_grad():
        mixed = {id(w) for w in _mixed_ok(model)}
        for w in _projections(model):
            if id(w) in mixed or w.dtype == torch.bfloat16:
                if w.dtype != torch.bfloat16 or not w.is_contiguous():
                    w.data = w.data.to(torch.bfloat16).contiguous()
            else:
                _column_major(w)


def float_projections(model: nn.Module, dtype: torch.dtype) -> None:
    """Undo ``amx_projections`` (the compiled steps did not load, and eager calls would convert
    every bfloat16 weight on each call): every projection weight back in ``dtype`` (exact: they
    are bfloat16 values), column-major."""
    with torch.no_grad():
        for w in _projections(model):
            if w.dtype != dtype:
                w.data = w.data.to(dtype)
    column_major_projections(model)
