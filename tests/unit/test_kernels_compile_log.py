"""TANDEM_LOG_COMPILES=1 (kernels/__init__.py: log_compiles): Triton's JIT hooks log each variant
specialised after start-up with its cost, never skip a compile; without the variable nothing
is installed."""

from __future__ import annotations

import logging

import pytest

from gpu_worker.kernels import log_compiles

pytest.importorskip("triton")


def test_hooks_log_and_never_skip(monkeypatch, caplog):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.delenv("TANDEM_LOG_COMPILES", raising=False)
    log_compiles(logging.getLogger("t"))
    assert knobs.runtime.jit_cache_hook is None
    monkeypatch.setenv("TANDEM_LOG_COMPILES", "1")
    log_compiles(logging.getLogger("t"))
    assert not knobs.runtime.jit_cache_hook(key=("k", 1), repr="ignored")  # falsy: compile goes on
    with caplog.at_level(logging.WARNING):
        knobs.runtime.jit_post_compile_hook(key=("k", 1), repr="_decode_kernel[num_warps=4](...)")
    assert "specialised while serving" in caplog.text and "_decode_kernel" in caplog.text
