import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: benchmarks/gpu_suite.sh)")
    for item in items:
        item.add_marker(skip)
