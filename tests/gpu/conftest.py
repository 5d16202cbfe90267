import os

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    # This hook sees every collected item of the session: only touch tests/gpu.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: benchmarks/gpu_suite.sh)")
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(skip)
