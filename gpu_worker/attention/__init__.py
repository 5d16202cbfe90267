"""Attention backends, chosen by name (--attention-backend).

``auto`` (the default) resolves to triton on CUDA (flashinfer if Triton is missing) and to torch
on the CPU. Triton first because it is faster end to end for our decode shapes
(docs/decisions/attention.md), and it serves MTP verify and draft reads, which the flashinfer
backend hands to triton anyway.
On the CPU ``triton`` runs our kernels in Triton's interpreter (``TRITON_INTERPRET=1``: slow,
for tests); ``flashinfer`` needs CUDA.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable

from gpu_worker.attention.base import AttentionBackend, RowLayout

log = logging.getLogger("tandem.worker")
_REGISTRY: dict[str, Callable[..., AttentionBackend]] = {}
_MODULES = {"torch": "torch_backend", "triton": "triton_backend", "flashinfer": "flashinfer_backend"}


def register(name: str):
    def deco(factory):
        _REGISTRY[name] = factory
        return factory

    return deco


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as absent
        return False
    return True


def resolve_backend(name: str, device_type: str) -> str:
    """The backend ``name`` stands for on this device; raises ValueError naming the flag."""
    from gpu_worker.kernels import interpreting, triton_available

    if name == "auto":
        if device_type != "cuda":
            return "torch"
        if triton_available():
            return "triton"
        return "flashinfer" if flashinfer_available() else "torch"
    if name == "flashinfer" and device_type != "cuda":
        raise ValueError("--attention-backend flashinfer: needs a CUDA device (use triton or torch on the CPU)")
    if name == "flashinfer" and not flashinfer_available():
        raise ValueError("--attention-backend flashinfer: flashinfer is not installed (pip install flashinfer-python)")
    if name == "triton" and not triton_available():
        raise ValueError("--attention-backend triton: triton is not installed (pip install triton)")
    if name == "triton" and device_type != "cuda" and not interpreting():
        raise ValueError("--attention-backend triton on the CPU: set TRITON_INTERPRET=1 (Triton's interpreter, "
                         "for tests) or use --attention-backend torch")
    return name


def create_backend(name: str, **kwargs) -> AttentionBackend:
    if name in _MODULES:
        importlib.import_module(f"gpu_worker.attention.{_MODULES[name]}")  # registers itself
    if name not in _REGISTRY:
        raise ValueError(f"--attention-backend: {name!r} is not available in this build")
    return _REGISTRY[name](**kwargs)


__all__ = ["AttentionBackend", "RowLayout", "create_backend", "register", "resolve_backend"]
