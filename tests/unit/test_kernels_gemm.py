"""The small-M decode GEMM (kernels/gemm.py) against fp32 matmul: tiles that do not divide the
shape, split K with a ragged tail, strided rows; the split sum's determinism; the launch shape
rule; and the dispatch rule that decides where it replaces F.linear."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import gemm as GM
from gpu_worker.kernels import gemv as G

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _close_to_fp32(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.float() @ w.float().t()
    assert y.shape == ref.shape and y.dtype == x.dtype
    # one rounding of an fp32 sum: within a bf16 ulp (the interpreter truncates where compiled
    # code rounds), plus fp32 reordering
    ulp = ref.abs().clamp_min(1.0) * 2.0**-7
    assert ((y.float() - ref).abs() <= ulp + 1e-3 * ref.abs().max()).all()


@pytest.mark.parametrize("m,n,k,cfg", [
    (20, 70, 300, GM.GemmConfig(16, 32, 64, 1)),     # ragged M, N and K
    (33, 64, 512, GM.GemmConfig(32, 32, 64, 2)),     # even K, two splits
    (17, 40, 1000, GM.GemmConfig(16, 16, 128, 4)),   # splits with a ragged tail
    (5, 24, 128, GM.GemmConfig(16, 16, 64, 4)),      # more splits than K chunks: empty splits add 0
])
def test_small_gemm_matches_matmul(m, n, k, cfg):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16).to(DEV)
    _close_to_fp32(GM.small_gemm(x, w, cfg), x, w)


def test_small_gemm_strided_rows_and_deterministic_split_sum():
    base = torch.randn(24, 300).to(torch.bfloat16).to(DEV)
    x = base[:, :256]  # a row view of a wider buffer (unit column stride only)
    w = torch.randn(48, 256).to(torch.bfloat16).to(DEV)
    cfg = GM.GemmConfig(16, 16, 64, 4)
    y = GM.small_gemm(x, w, cfg)
    _close_to_fp32(y, x, w)
    assert torch.equal(y, GM.small_gemm(x, w, cfg))


def test_small_gemm_empty_rows():
    w = torch.randn(8, 64).to(torch.bfloat16).to(DEV)
    assert GM.small_gemm(torch.empty(0, 64, dtype=torch.bfloat16, device=DEV), w).shape == (0, 8)


@pytest.mark.parametrize("m", [16, 64, 100, 144, 256])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)])
def test_config_fills_the_sms_once_at_most(m, n, k):
    sms = 132
    c = GM.pick_config(m, n, k, sms)
    tiles = -(-m // c.block_m) * -(-n // c.block_n)
    assert c.split_k & (c.split_k - 1) == 0 and c.split_k >= 1
    assert c.split_k == 1 or (tiles * c.split_k <= sms and k // c.split_k >= 256)
    assert tiles * c.split_k * 2 > sms or k // (2 * c.split_k) < 256  # no further split would still fit
    assert c.block_m >= 16 and -(-m // c.block_m) <= 2


def test_linear_dispatch(monkeypatch):
    """Which rows and weights take the small GEMM: tens to hundreds of rows, small weights,
    bf16/fp16, Triton usable for the tensor; F.linear elsewhere (and always with a bias)."""
    monkeypatch.setattr(G, "use_triton", lambda x: True)
    bf = torch.bfloat16
    w = torch.empty(1024, 2048, dtype=bf)
    big = torch.empty(14336, 4096, dtype=bf)
    assert G.small_gemm_fits(torch.empty(64, 2048, dtype=bf), w)
    assert G.small_gemm_fits(torch.empty(256, 2048, dtype=bf), w)
    assert not G.small_gemm_fits(torch.empty(8, 2048, dtype=bf), w)      # few rows: GEMV / cuBLAS
    assert not G.small_gemm_fits(torch.empty(512, 2048, dtype=bf), w)    # prefill-sized: cuBLAS
    assert not G.small_gemm_fits(torch.empty(64, 4096, dtype=bf), big)   # large weight: cuBLAS streams it well
    assert not G.small_gemm_fits(torch.empty(64, 2048, dtype=torch.float32), w.float())
    monkeypatch.setattr(G, "use_triton", lambda x: False)
    assert not G.small_gemm_fits(torch.empty(64, 2048, dtype=bf), w)
