"""The draft's input row kernel (kernels/embed.py): bitwise ``cat(table[ids] * scale, tail)``
as torch computes it (under the interpreter, bf16 within the ulp its truncation costs), for the
model dtypes, widths past one block and uneven ones, several rows, repeated ids and ids read from
a column of the draft's token buffer; the scaled embedding alone (no tail) likewise; the torch
path where Triton does not run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels import enable_cpu_kernels, interpreting
from gpu_worker.kernels.embed import MAX_BLOCK, embed_cat, embed_scaled

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(ids, table, scale, tail):
    return torch.cat([F.embedding(ids, table) * scale, tail], dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h,ht,rows", [(64, 64, 1), (48, 80, 3), (MAX_BLOCK + 24, 40, 2), (24, MAX_BLOCK + 8, 1)])
def test_kernel_equals_torch(dtype, h, ht, rows):
    g = torch.Generator().manual_seed(h * 7 + ht + rows)
    table = torch.randn(50, h, generator=g).to(dtype).to(DEV)
    tail = torch.randn(rows, ht, generator=g).to(dtype).to(DEV)
    ids = torch.randint(0, 50, (rows,), generator=g).to(DEV)
    if rows > 1:
        ids[-1] = ids[0]  # a repeated token
    scale = float(torch.tensor(h**0.5).to(dtype))  # as Gemma's dtype-rounded sqrt(hidden)
    enable_cpu_kernels(True)
    try:
        got = embed_cat(ids, table, scale, tail)
    finally:
        enable_cpu_kernels(False)
    want = _reference(ids, table, scale, tail)
    assert got.dtype == dtype and got.shape == (rows, h + ht)
    assert torch.equal(got[:, h:], tail)
    if dtype == torch.bfloat16 and interpreting():  # the interpreter truncates to bf16, compiled code rounds
        torch.testing.assert_close(got[:, :h].float(), want[:, :h].float(), rtol=2.0**-7, atol=0)
    else:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def _close_or_equal(got, want, dtype):
    if dtype == torch.bfloat16 and interpreting():  # the interpreter truncates to bf16, compiled code rounds
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=0)
    else:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h,rows", [(64, 1), (MAX_BLOCK + 24, 3)])
def test_embed_scaled_and_strided_ids(dtype, h, rows):
    g = torch.Generator().manual_seed(h + rows)
    table = torch.randn(50, h, generator=g).to(dtype).to(DEV)
    tokens = torch.randint(0, 50, (rows, 4), generator=g).to(DEV)
    ids = tokens[:, 2]  # a column: stride 4
    scale = float(torch.tensor(h**0.5).to(dtype))
    tail = torch.randn(rows, 8, generator=g).to(dtype).to(DEV)
    enable_cpu_kernels(True)
    try:
        got, got_cat = embed_scaled(ids, table, scale), embed_cat(ids, table, scale, tail)
    finally:
        enable_cpu_kernels(False)
    want = F.embedding(ids.contiguous(), table) * scale
    assert got.dtype == dtype and got.shape == (rows, h)
    _close_or_equal(got, want, dtype)
    _close_or_equal(got_cat, _reference(ids.contiguous(), table, scale, tail), dtype)
    assert torch.equal(embed_scaled(ids, table, scale), want)  # kernels off: torch's ops


def test_torch_path_and_empty_rows():
    table = torch.randn(10, 8, dtype=torch.bfloat16)
    tail = torch.randn(2, 4, dtype=torch.bfloat16)
    ids = torch.tensor([3, 9])
    assert torch.equal(embed_cat(ids, table, 2.5, tail), _reference(ids, table, 2.5, tail))  # kernels off
    enable_cpu_kernels(True)
    try:
        empty = embed_cat(ids[:0], table, 2.5, tail[:0])
    finally:
        enable_cpu_kernels(False)
    assert empty.shape == (0, 12)
