"""The GEMV's fused prologue and epilogue (kernels/gemv.py) against the separate kernels they
replace: the MLP activation read from a gate_up output (``act_in``) and the residual add + RMSNorm
applied by the launch's last tile (``norm``, Llama's add-then-norm and Gemma's sandwich step),
then the model-level ``project_then`` / ``GatedMLP.forward_then`` and their fallbacks."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import enable_cpu_kernels, tickets_clear
from gpu_worker.kernels import gemv as G
from gpu_worker.kernels.activation import gated_act
from gpu_worker.kernels.norm import MODE_ADD_NORM, MODE_NORM_ADD, RowNorm, launch_norm

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF = torch.bfloat16


def _rand(*shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(BF).to(DEV)


def _close(a, b):
    """Equal up to the fp32 order of the sum of squares: a bf16 ulp here and there."""
    torch.testing.assert_close(a.float(), b.float(), rtol=2.0**-7, atol=1e-2)


CFGS = {"fma": dict(block_n=8, block_k=64, num_stages=2), "dot": dict(block_n=16, block_k=64, num_stages=2, dot=True)}


@pytest.mark.parametrize("kind", ["fma", "dot"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("case", ["llama", "gemma", "gemma_scale_next", "gemma_no_weight"])
def test_norm_epilogue_equals_gemv_then_norm(kind, splits, m, case):
    g = torch.Generator().manual_seed(m * 7 + splits)
    n, k = 40, 200  # N not a power of two, not a multiple of the tile (masked columns)
    x, w = _rand(m, k, g=g), _rand(n, k, g=g, scale=0.2)
    r0 = _rand(m, n, g=g)
    w1, w2 = _rand(n, g=g), _rand(n, g=g)
    scale = torch.tensor([0.75], dtype=BF, device=DEV)
    mode, gemma = (MODE_ADD_NORM, False) if case == "llama" else (MODE_NORM_ADD, True)
    spec = dict(w1=None if case == "gemma_no_weight" else w1, w2=w2 if case != "gemma_no_weight" else None,
                scale=scale if case == "gemma_scale_next" else None)
    if case == "gemma":
        spec["w2"] = None
    cfg = dict(CFGS[kind], splits=splits)
    enable_cpu_kernels(True)
    try:
        r_fused = r0.clone()
        out = G.gemv(x, w, norm=RowNorm(mode, r_fused, eps=1e-5, gemma=gemma, **spec), **cfg)
        y = G.gemv(x, w, **cfg)
        r_ref = r0.clone()
        ref = launch_norm(mode, y, r_ref, spec["w1"], spec["w2"], spec["scale"], 1e-5, gemma=gemma)
    finally:
        enable_cpu_kernels(False)
    if mode == MODE_ADD_NORM:
        assert torch.equal(r_fused, r_ref)  # y + r: the same bits
    _close(r_fused, r_ref)
    if ref is None:
        assert out is None
    else:
        assert out.shape == (m, n)
        _close(out, ref)
    assert tickets_clear()


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("m", [1, 4])
def test_act_in_equals_act_then_gemv(act, splits, m):
    """The dot kernel reading act(gate) * up from a gate_up output is the activation kernel
    followed by the GEMV, bit for bit (the same input values, the same sums)."""
    g = torch.Generator().manual_seed(11 + m)
    k, n = 96, 48
    gu, w = _rand(m, 2 * k, g=g), _rand(n, k, g=g, scale=0.2)
    cfg = dict(CFGS["dot"], splits=splits)
    enable_cpu_kernels(True)
    try:
        fused = G.gemv(gu, w, act_in=act, **cfg)
        ref = G.gemv(gated_act(gu[:, :k], gu[:, k:], act), w, **cfg)
    finally:
        enable_cpu_kernels(False)
    assert torch.equal(fused, ref)


def test_fused_plan_rules(monkeypatch):
    """Where the fusions apply: the GEMV's shapes, act_in only with the tensor-core variant, and
    each switched off by its variable."""
    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 1)
    monkeypatch.setattr(G, "BIG_WEIGHT", 64 * 64)
    small, big = _rand(32, 32, g=torch.Generator()), _rand(64, 64, g=torch.Generator())
    one, gu = torch.zeros(1, 32, dtype=BF, device=DEV), torch.zeros(1, 128, dtype=BF, device=DEV)
    enable_cpu_kernels(True)
    try:
        assert G.fused_plan(one, small, norm=True) == dict(G.CONFIG, splits=1)  # FMA at one row
        assert G.fused_plan(gu, big, act_in="silu", norm=True)["dot"]
        assert G.fused_plan(torch.zeros(1, 64, dtype=BF, device=DEV), small, act_in="silu") is None  # FMA: no act_in
        assert G.fused_plan(gu, big, act_in="relu2") is None
        assert G.fused_plan(torch.zeros(5, 32, dtype=BF, device=DEV), small, norm=True) is None  # 5 rows: cuBLAS
        monkeypatch.setenv("TANDEM_GEMV_NORM", "0")
        assert G.fused_plan(one, small, norm=True) is None
        assert G.fused_plan(gu, big, act_in="silu") is not None
        monkeypatch.setenv("TANDEM_GEMV_ACT_IN", "0")
        assert G.fused_plan(gu, big, act_in="silu") is None
    finally:
        enable_cpu_kernels(False)


def _mlp_and_norms(monkeypatch, act):
    from gpu_worker.models.layers import GatedMLP, GemmaRMSNorm, Linear, RMSNorm

    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 1)
    monkeypatch.setattr(G, "BIG_WEIGHT", 1)  # every projection on the tensor-core variant: act_in applies
    torch.manual_seed(5)
    mlp = GatedMLP(64, 96, act).to(BF).to(DEV)
    o_proj = Linear(64, 64, bias=False).to(BF).to(DEV)
    norms = [RMSNorm(64, 1e-5), GemmaRMSNorm(64, 1e-6), GemmaRMSNorm(64, 1e-6)]
    for nm in norms:
        nm.weight.data.normal_()
    return mlp, o_proj, [nm.to(BF).to(DEV) for nm in norms]


@pytest.mark.parametrize("rows", [1, 2, 6])
def test_project_then_and_forward_then_equal_the_separate_steps(monkeypatch, rows):
    """o_proj + AddNorm / NormAdd and the MLP + its norm, fused (one or two launches) or not (6
    rows: cuBLAS and the separate kernels), give the unfused modules' results."""
    from gpu_worker.models.layers import AddNorm, NormAdd, project_then

    mlp, o_proj, (llama_norm, gemma1, gemma2) = _mlp_and_norms(monkeypatch, "silu")
    g = torch.Generator().manual_seed(rows)
    x, r0 = _rand(rows, 64, g=g), _rand(rows, 64, g=g)
    scale = torch.tensor([0.5], dtype=BF, device=DEV)
    launches = []
    real = G.gemv
    monkeypatch.setattr("gpu_worker.models.layers.gemv", lambda *a, **kw: launches.append(kw) or real(*a, **kw))
    enable_cpu_kernels(True)
    try:
        for after in (AddNorm(llama_norm), NormAdd(gemma1, gemma2, scale), NormAdd(gemma1)):
            r_f, r_u = r0.clone(), r0.clone()
            out_f, r_f = project_then(o_proj, x, r_f, after)
            out_u, r_u = after(o_proj(x), r_u)
            _close(r_f, r_u)
            assert (out_f is None) == (out_u is None)
            if out_u is not None:
                _close(out_f, out_u)
            r_f, r_u = r0.clone(), r0.clone()
            out_f, r_f = mlp.forward_then(x, r_f, after)
            out_u, r_u = after(mlp(x), r_u)
            _close(r_f, r_u)
            if out_u is not None:
                _close(out_f, out_u)
    finally:
        enable_cpu_kernels(False)
    fused = [kw for kw in launches if kw.get("norm") is not None]
    assert len(fused) == (6 if rows <= G.skinny_rows() else 0)
    assert sum(kw.get("act_in") == "silu" for kw in fused) == (3 if rows <= G.skinny_rows() else 0)
    assert tickets_clear()


def test_project_then_falls_back(monkeypatch):
    """A bias, a strided residual or the torch path: the separate steps, the same values."""
    from gpu_worker.models.layers import AddNorm, Linear, project_then

    _, _, (llama_norm, _, _) = _mlp_and_norms(monkeypatch, "silu")
    g = torch.Generator().manual_seed(3)
    biased = Linear(64, 64, bias=True).to(BF).to(DEV)
    x = _rand(1, 64, g=g)
    wide = _rand(1, 128, g=g)
    monkeypatch.setattr("gpu_worker.models.layers.gemv", lambda *a, **kw: pytest.fail("fused launch"))
    enable_cpu_kernels(True)
    try:
        out, r = project_then(biased, x, _rand(1, 64, g=g), AddNorm(llama_norm))
        assert out.shape == (1, 64)
        r_strided = wide[:, ::2]
        project_then(Linear(64, 64, bias=False).to(BF).to(DEV), x, r_strided, AddNorm(llama_norm))
    finally:
        enable_cpu_kernels(False)
