"""Attention backends, chosen by name (--attention-backend)."""

from __future__ import annotations

from typing import Callable

from gpu_worker.attention.base import AttentionBackend, RowLayout

_REGISTRY: dict[str, Callable[..., AttentionBackend]] = {}


def register(name: str):
    def deco(factory):
        _REGISTRY[name] = factory
        return factory

    return deco


def create_backend(name: str, **kwargs) -> AttentionBackend:
    if name == "torch":
        from gpu_worker.attention import torch_backend  # noqa: F401  (registers itself)
    if name not in _REGISTRY:
        raise ValueError(f"--attention-backend: {name!r} is not available in this build")
    return _REGISTRY[name](**kwargs)


__all__ = ["AttentionBackend", "RowLayout", "create_backend", "register"]
