"""The compiled CPU steps' library (``graphs/cpu_ops.py``), built and loaded once per module that
asks for it: eager calls of its ops then run its kernels, as the programs do."""

from __future__ import annotations

import os

import pytest

from gpu_worker.graphs import cpu_ops
from gpu_worker.graphs.cpu_build import cache_root, compiler_missing


@pytest.fixture(scope="module")
def lib():
    if compiler_missing() is not None:
        pytest.skip("no C++ compiler: the library cannot be built")
    key_dir = os.path.join(cache_root(), "gemm-test")  # the library is shared with the programs' builds
    os.makedirs(key_dir, exist_ok=True)
    if cpu_ops.build_library(key_dir) is None:
        pytest.skip("Inductor finds no vector ISA on this CPU: no library")
    loaded = cpu_ops.load_library(key_dir)
    assert loaded is not None
    cpu_ops.define()
    yield loaded
    cpu_ops._loaded.clear()
