"""``gpu_worker.parallel`` sits below the model files: importing it loads no model module, so
models/layers -> parallel/factory -> parallel/layers is a one-way chain (no import circle)."""

from __future__ import annotations

import subprocess
import sys


def test_parallel_package_imports_no_model_module():
    code = ("import sys, gpu_worker.parallel.factory, gpu_worker.parallel.layers, gpu_worker.parallel.linear; "
            "print(sorted(m for m in sys.modules if m.startswith('gpu_worker.models')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
