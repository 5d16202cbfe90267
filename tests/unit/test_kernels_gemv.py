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


def _gated_ref(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """HF's MLP middle in the model dtype (act rounded, then the product rounded)."""
    from gpu_worker.models.layers import activation

    g, u = gate_up.float().chunk(2, dim=-1)
    a = activation(act)(g).to(gate_up.dtype)
    return (a.float() * u).to(gate_up.dtype)


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_gated_input_matches_act_then_matmul(act, m):
    """``down(act(gate) * up)`` in one launch equals the activation kernel followed by the GEMV
    (same rounding of the input, same summation order), and the float reference within the
    input's rounding (fresh random inputs per case, ragged K and N tiles)."""
    from gpu_worker.kernels.activation import gated_act

    g = torch.Generator().manual_seed(7 + m)
    k, n = 300, 70
    gate_up = (torch.randn(m, 2 * k, generator=g) * 2).to(torch.bfloat16).to(DEV)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16).to(DEV)
    y = G.gemv(gate_up, w, act=act, block_n=16, block_k=128, num_stages=2)
    gate, up = gate_up.chunk(2, dim=-1)
    enable_cpu_kernels(True)
    try:
        two_step = G.gemv(gated_act(gate, up, act), w, block_n=16, block_k=128, num_stages=2)
    finally:
        enable_cpu_kernels(False)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, two_step, rtol=2.0**-7, atol=0)  # at most a last-bit difference
    x = _gated_ref(gate_up, act).float()
    bound = (w.float().abs() @ x.abs().t()).t() * 2.0**-7 + y.float().abs() * 2.0**-7  # input + output rounding
    assert ((y.float() - x @ w.float().t()).abs() <= bound).all()


def test_gated_linear_dispatch(monkeypatch):
    """One row through a large-enough down weight is fused; otherwise (more rows, flag off, wrong
    width, the plain CPU path) the caller runs act and down separately (None)."""
    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 16 * 32)
    monkeypatch.setenv("TANDEM_FUSED_DOWN", "1")
    w = torch.randn(16, 32).to(torch.bfloat16).to(DEV)
    one = torch.randn(1, 64).to(torch.bfloat16).to(DEV)
    enable_cpu_kernels(True)
    try:
        out = G.gated_linear(one, w, "silu")
        assert out is not None
        torch.testing.assert_close(out.float(), _gated_ref(one, "silu").float() @ w.float().t(), rtol=2e-2, atol=5e-2)
        assert G.gated_linear(torch.randn(2, 64).to(torch.bfloat16).to(DEV), w, "silu") is None
        assert G.gated_linear(one[:, :48], w, "silu") is None
        monkeypatch.setenv("TANDEM_FUSED_DOWN", "0")
        assert G.gated_linear(one, w, "silu") is None
    finally:
        enable_cpu_kernels(False)
    if DEV == "cpu":
        assert G.gated_linear(one, w, "silu") is None  # kernels off: the torch reference path


def test_gated_mlp_fused_equals_unfused(monkeypatch):
    """GatedMLP at one row takes the fused GEMV and gives the unfused path's output."""
    from gpu_worker.models.layers import GatedMLP

    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 1)
    monkeypatch.setenv("TANDEM_FUSED_DOWN", "1")
    torch.manual_seed(3)
    mlp = GatedMLP(64, 96, "silu").to(torch.bfloat16).to(DEV)
    x = torch.randn(1, 64).to(torch.bfloat16).to(DEV)
    calls = []
    real = G.gemv
    monkeypatch.setattr(G, "gemv", lambda *a, **kw: calls.append(kw.get("act")) or real(*a, **kw))
    enable_cpu_kernels(True)
    try:
        fused = mlp(x)
        monkeypatch.setenv("TANDEM_FUSED_DOWN", "0")
        unfused = mlp(x)
    finally:
        enable_cpu_kernels(False)
    assert "silu" in calls  # the fused path ran
    torch.testing.assert_close(fused.float(), unfused.float(), rtol=2e-2, atol=2e-2)
