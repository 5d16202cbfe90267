"""Programmatic dependent launch (kernels/__init__.py) and the GEMV's pre-wait prefetch budget
(kernels/gemv.py): which launches take PDL, and how many weight columns a launch prefetches."""

from __future__ import annotations

import types

import pytest
import torch

import gpu_worker.kernels as K
from gpu_worker.kernels import PDL_MAX_TOKENS, PDL_OFF, PDL_ON, pdl
from gpu_worker.kernels import gemv as G

pytest.importorskip("triton")


def _cuda_rows(n: int):
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), shape=(n, 4096))


def test_pdl_takes_small_forwards_on_hopper_only(monkeypatch):
    """Forwards of at most PDL_MAX_TOKENS tokens launch with PDL on a device that supports it;
    larger ones, older devices and CPU tensors never do."""
    assert pdl(torch.zeros(1)) == PDL_OFF  # a CPU tensor
    monkeypatch.setattr(K, "_pdl_device", lambda index: True)
    assert pdl(_cuda_rows(1)) == pdl(_cuda_rows(PDL_MAX_TOKENS)) == PDL_ON
    assert pdl(_cuda_rows(PDL_MAX_TOKENS + 1)) == PDL_OFF
    monkeypatch.setattr(K, "_pdl_device", lambda index: False)
    assert pdl(_cuda_rows(1)) == PDL_OFF


def test_prefetch_budget_is_shared_by_the_whole_launch():
    """A PDL-launched GEMV pulls PREFETCH_MB (4 MB) of weight columns into L2 before its wait,
    split over its rows and K splits, in powers of two, at most one K chunk, none below 16."""
    assert G.prefetch_cols(4096, 1, 4096) == 512
    assert G.prefetch_cols(28672, 1, 4096) == 64  # gate_up: its programs share the same 4 MB
    assert G.prefetch_cols(4096, 4, 3584, mb=16) == 512  # four K chunks share the budget
    assert G.prefetch_cols(4096, 1, 256, mb=16) == 256  # never past the chunk
    assert G.prefetch_cols(1 << 20, 1, 4096) == 0
    assert G.prefetch_cols(4096, 1, 4096, mb=0) == 0
