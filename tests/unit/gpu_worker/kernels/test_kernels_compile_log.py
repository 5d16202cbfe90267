"""``TANDEM_LOG_COMPILES=1`` (gpu_worker/settings.py, then kernels/__init__.py: log_compiles):
Triton's JIT hooks log each variant specialised after start-up with its cost and never skip a
compile; the worker installs them only under the setting."""

from __future__ import annotations

import logging

import pytest

from gpu_worker.kernels import log_compiles
from gpu_worker.settings import DevSettings

pytest.importorskip("triton")


def test_settings_are_read_from_the_environment():
    assert DevSettings.from_env({}) == DevSettings()
    on = DevSettings.from_env({"TANDEM_LOG_COMPILES": "1", "TANDEM_HOST_TIMING": "1",
                               "TANDEM_EMULATE_CUDA_GRAPHS": "0"})
    assert on.log_compiles and on.host_timing and not on.emulate_cuda_graphs


def test_hooks_log_and_never_skip(monkeypatch, caplog):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    log_compiles(logging.getLogger("t"))
    assert not knobs.runtime.jit_cache_hook(key=("k", 1), repr="ignored")  # falsy: compile goes on
    with caplog.at_level(logging.WARNING):
        knobs.runtime.jit_post_compile_hook(key=("k", 1), repr="_decode_kernel[num_warps=4](...)")
    assert "specialised while serving" in caplog.text and "_decode_kernel" in caplog.text
