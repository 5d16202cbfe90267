"""Triton is optional (CPU images install without it): every module of the worker imports with
``import triton`` failing, and the CPU path runs a forward."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.server import ROOT

SCRIPT = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import pkgutil, importlib, gpu_worker
for m in pkgutil.walk_packages(gpu_worker.__path__, "gpu_worker."):
    importlib.import_module(m.name)
import torch
from gpu_worker.models.layers import GatedMLP, RMSNorm
x = torch.randn(1, 16)
assert GatedMLP(16, 32, "silu")(RMSNorm(16, 1e-6)(x)).shape == (1, 16)
print("ok")
"""


def test_worker_imports_and_runs_without_triton():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
