"""The skinny decode GEMM (kernels/gemv.py) against fp32 matmul, and the dispatch rule that
decides where it replaces F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels import enable_cpu_kernels
from gpu_worker.kernels import gemv as G

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k,block_n,block_k", [(70, 300, 16, 128), (8, 64, 8, 64), (33, 1000, 32, 256)])
def test_gemv_matches_matmul(m, n, k, block_n, block_k):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16).to(DEV)
    y = G.gemv(x, w, block_n=block_n, block_k=block_k, num_stages=2)
    ref = x.float() @ w.float().t()
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # one rounding of an fp32 sum: within a bf16 ulp of the exact product (plus fp32 reordering)
    # (the interpreter truncates to bf16 where compiled code rounds: allow a whole ulp)
    ulp = ref.abs().clamp_min(1.0) * 2.0**-7
    assert ((y.float() - ref).abs() <= ulp + 1e-3 * ref.abs().max()).all()


def test_gemv_strided_rows():
    """x may be a row view of a wider buffer (unit column stride only)."""
    base = torch.randn(3, 200).to(torch.bfloat16).to(DEV)
    x = base[:, :128]
    w = torch.randn(24, 128).to(torch.bfloat16).to(DEV)
    y = G.gemv(x, w, block_n=8, block_k=64)
    torch.testing.assert_close(y.float(), (x.float() @ w.float().t()), rtol=1e-2, atol=1e-1)


def test_linear_dispatch(monkeypatch):
    """One bf16 row through a large-enough weight takes the kernel; everything else F.linear."""
    calls = []
    monkeypatch.setattr(G, "gemv", lambda x, w, **kw: calls.append(x.shape) or F.linear(x, w))
    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 64 * 32)
    enable_cpu_kernels(True)
    try:
        w = torch.randn(64, 32).to(torch.bfloat16).to(DEV)
        G.linear(torch.randn(1, 32).to(torch.bfloat16).to(DEV), w)
        assert calls == [(1, 32)]
        G.linear(torch.randn(2, 32).to(torch.bfloat16).to(DEV), w)  # two rows: cuBLAS
        G.linear(torch.randn(1, 32).to(DEV), w.float())  # float32: cuBLAS
        G.linear(torch.randn(1, 32).to(torch.bfloat16).to(DEV), w[:32])  # too small: cuBLAS
        G.linear(torch.randn(1, 32).to(torch.bfloat16).to(DEV), w, torch.zeros(64, dtype=w.dtype, device=DEV))
        assert calls == [(1, 32)]
    finally:
        enable_cpu_kernels(False)
