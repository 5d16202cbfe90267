"""Greedy selection's kernel (kernels/argmax.py) against torch.argmax: first index on ties
(inside a chunk and across chunks), rows of -inf, ragged vocabularies, 3-D views, float32 and
bf16; and torch's path where Triton does not run the tensor."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import argmax as A
from gpu_worker.kernels import enable_cpu_kernels

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def kernels_on_cpu():
    enable_cpu_kernels(True)
    yield
    enable_cpu_kernels(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 5000), (7, 2048), (3, 4097), (2, 17)])
def test_matches_torch_with_ties(rows, vocab, dtype):
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randint(-4, 4, (rows, vocab), generator=g).to(dtype)  # many ties per row
    x[0, vocab - 1] = 9  # the maximum in the last chunk
    if vocab > A.BLOCK + 5:
        x[-1, 3] = x[-1, A.BLOCK + 5] = 11  # tie across chunks: the first chunk's index wins
    x = x.to(DEV)
    assert torch.equal(A.argmax_last(x), x.argmax(-1))


def test_all_minus_inf_row_and_views():
    x = torch.randn(2, 3, 3000).to(DEV)
    x[1, 2] = float("-inf")
    got = A.argmax_last(x)
    assert got.shape == (2, 3) and got.dtype == torch.int64
    assert torch.equal(got, x.argmax(-1))
    flat = x.view(6, 3000)
    assert torch.equal(A.argmax_last(flat[::2]), flat[::2].argmax(-1))  # strided rows


def test_torch_path_where_triton_does_not_run(monkeypatch):
    monkeypatch.setattr(A, "use_triton", lambda x: False)
    monkeypatch.setattr(A, "_chunk_max_kernel", None)  # a launch would fail
    x = torch.randn(4, 100).to(DEV)
    assert torch.equal(A.argmax_last(x), x.argmax(-1))


@pytest.mark.parametrize("kernels", [True, False])
def test_out_into_a_strided_column(kernels, monkeypatch):
    """The draft chain writes each step's tokens into a column of its [B, T] token buffer: only
    that column changes, and the call returns it."""
    if not kernels:
        monkeypatch.setattr(A, "use_triton", lambda x: False)
    x = torch.randn(3, 4500).to(DEV)
    tokens = torch.full((3, 4), -1, dtype=torch.int64, device=DEV)
    got = A.argmax_last(x, tokens[:, 2])
    assert got.data_ptr() == tokens[:, 2].data_ptr() and torch.equal(tokens[:, 2], x.argmax(-1))
    assert (tokens[:, [0, 1, 3]] == -1).all()
