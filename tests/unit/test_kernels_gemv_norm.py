"""The GEMV's norm fusion (kernels/gemv.py): ``gemv_add`` (the residual add in the epilogue, and
each output tile's sum of squares; both kernels) and ``Prenorm`` (the next projection norming
its input from those sums; the FMA kernel), against the separate kernels they replace; and the
model seam (models/layers.py ``ResidualStream``) that picks them or the add-norm kernel."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import enable_cpu_kernels, tickets_clear
from gpu_worker.kernels import gemv as G
from gpu_worker.kernels.norm import MODE_NORM, launch_norm

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF = torch.bfloat16


def _rand(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF).to(DEV)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise on the GPU; within one bf16 ulp under the interpreter, which truncates where
    compiled code (and torch) round to nearest."""
    if DEV == "cuda":
        return torch.equal(a, b)
    return bool(((a.float() - b.float()).abs() <= b.float().abs() * 2.0**-7 + 1e-6).all())


def _normed_ref(r: torch.Tensor, sumsq: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm given the rows' sums of squares (float32, IEEE div / sqrt as the kernel)."""
    inv = 1.0 / torch.sqrt(sumsq.sum(-1, keepdim=True) / r.shape[-1] + eps)
    return (w.float() * (r.float() * inv).to(r.dtype).float()).to(r.dtype)


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_gemv_add_is_gemv_then_add(m, splits, dot):
    """The sum equals the plain GEMV's output plus the residual, rounded once more (bitwise: the
    same accumulation), and sumsq holds each tile's sum of squares of that sum."""
    n, k, block_n = 70, 300, 16 if dot else 8
    x, w, r = _rand(m, k, seed=m), _rand(n, k, seed=10 + m), _rand(m, n, seed=20 + m, scale=4.0)
    r_before = r.clone()
    y, sumsq = G.gemv_add(x, w, r, splits=splits, block_n=block_n, block_k=128, num_stages=2, dot=dot)
    plain = G.gemv(x, w, splits=splits, block_n=block_n, block_k=128, num_stages=2, dot=dot)
    assert _same(y, (plain.float() + r.float()).to(BF))
    assert torch.equal(r, r_before)  # the residual is read, never written
    tiles = -(-n // block_n)
    assert sumsq.shape == (m, tiles) and sumsq.dtype == torch.float32
    pad = torch.zeros(m, tiles * block_n, device=DEV)
    pad[:, :n] = y.float() ** 2
    torch.testing.assert_close(sumsq, pad.view(m, tiles, block_n).sum(-1), rtol=1e-5, atol=1e-5)
    assert tickets_clear()


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_prenorm_is_norm_then_gemv(m, splits):
    """The FMA kernel norming its input: with one sum per row the 1 / RMS is the reference's to the
    bit, so the result equals the GEMV of the reference-normed input bitwise (on the GPU; the
    interpreter truncates); with several tiles, within the sum's reordering. The tensor-core
    kernel takes no prenorm (measured slower)."""
    n, k, eps = 40, 256, 1e-5
    r, w, nw = _rand(m, k, seed=m, scale=3.0), _rand(n, k, seed=5 + m), _rand(k, seed=9 + m)
    kw = dict(splits=splits, block_n=8, block_k=64, num_stages=2)
    one = (r.double() ** 2).sum(-1, keepdim=True).float()
    y = G.gemv(r, w, prenorm=G.Prenorm(one, nw, eps), **kw)
    ref1 = G.gemv(_normed_ref(r, one, nw, eps), w, **kw)
    if DEV == "cuda":
        assert torch.equal(y, ref1)
    tiles = (r.float() ** 2).view(m, 8, k // 8).sum(-1).contiguous()
    y8 = G.gemv(r, w, prenorm=G.Prenorm(tiles, nw, eps), **kw)
    xn = _normed_ref(r, one, nw, eps).float()
    ref = xn @ w.float().t()
    # each normed input within two bf16 roundings (truncations under the interpreter), the output
    # within one: bounded through |x| @ |w|
    bound = 2.0**-6 * (xn.abs() @ w.float().abs().t()) + ref.abs() * 2.0**-7
    assert ((y8.float() - ref).abs() <= bound).all()
    with pytest.raises(AssertionError):
        G.gemv(r, w, prenorm=G.Prenorm(one, nw, eps), block_n=16, block_k=64, dot=True)


def test_add_then_prenorm_equals_add_norm_kernel_chain():
    """o_proj-like gemv_add, then a gate_up-like Prenorm GEMV: the same values as the unfused
    chain (GEMV, add-norm kernel, GEMV) up to the sum of squares' order."""
    m, h, n = 2, 128, 96
    x, wo, wg = _rand(m, 64, seed=1), _rand(h, 64, seed=2), _rand(n, h, seed=3)
    r, nw = _rand(m, h, seed=4, scale=2.0), _rand(h, seed=5)
    enable_cpu_kernels(True)
    try:
        s, sumsq = G.gemv_add(x, wo, r, block_n=8, block_k=64)
        fused = G.gemv(s, wg, prenorm=G.Prenorm(sumsq, nw, 1e-6), block_n=8, block_k=64)
        s_ref = (G.gemv(x, wo, block_n=8, block_k=64).float() + r.float()).to(BF)
        normed = launch_norm(MODE_NORM, s, None, nw, None, None, 1e-6, gemma=False)
        unfused = G.gemv(normed, wg, block_n=8, block_k=64)
    finally:
        enable_cpu_kernels(False)
    assert _same(s, s_ref)
    # the same roundings in the same kernels; only the sum of squares' order differs (an fp32
    # ulp of 1 / RMS, which may move a normed input by one bf16 ulp)
    bound = 2.0**-7 * (normed.float().abs() @ wg.float().abs().t()) + unfused.float().abs() * 2.0**-7
    assert ((fused.float() - unfused.float()).abs() <= bound).all()


def test_residual_stream_seam(monkeypatch):
    """``linear_add`` adds in the GEMV epilogue where the projection takes the GEMV (TP=1, no
    bias, switched on) and its consumer can norm its own input (the FMA kernel), and leaves the
    output pending otherwise; ``norm_linear`` norms in the prologue when the stream carries sums,
    else runs the (add-)norm kernel first. Either way the values agree with the plain block."""
    from gpu_worker.models.layers import Linear, ResidualStream, RMSNorm, linear_add, norm_linear

    monkeypatch.setattr(G, "SKINNY_MIN_WEIGHT", 1)
    torch.manual_seed(0)
    o = Linear(64, 128, bias=False).to(BF).to(DEV)
    up = Linear(128, 96, bias=False).to(BF).to(DEV)
    biased = Linear(64, 128, bias=True).to(BF).to(DEV)
    norm = RMSNorm(128, 1e-6).to(BF).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(128) + 0.5)
    x, r = _rand(1, 64, seed=7), _rand(1, 128, seed=8)
    enable_cpu_kernels(True)
    try:
        s = linear_add(o, x, ResidualStream(r.clone()), up)
        assert s.pending is None and s.sumsq is not None
        y, s2 = norm_linear(up, norm, s)
        assert s2 is s
        pending = [linear_add(o, x, ResidualStream(r.clone()), None),  # no consumer (the final norm)
                   linear_add(biased, x, ResidualStream(r.clone()), up)]  # bias: no epilogue
        monkeypatch.setattr(G, "BIG_WEIGHT", 1)  # the consumer on the tensor-core kernel
        pending.append(linear_add(o, x, ResidualStream(r.clone()), up))
        monkeypatch.setattr(G, "BIG_WEIGHT", 48 << 20)
        monkeypatch.setenv("TANDEM_GEMV_FUSE_NORM", "0")
        p = linear_add(o, x, ResidualStream(r.clone()), up)
        pending.append(p)
        assert all(q.pending is not None and q.sumsq is None for q in pending)
        y_off, p2 = norm_linear(up, norm, p)
        assert p2.pending is None and torch.equal(p2.r, s.r)
    finally:
        enable_cpu_kernels(False)
    torch.testing.assert_close(y.float(), y_off.float(), rtol=2.0**-7, atol=1e-2)
    ref_r = (x.float() @ o.weight.float().t()).to(BF).float() + r.float()
    torch.testing.assert_close(s.r.float(), ref_r.to(BF).float(), rtol=2.0**-7, atol=1e-2)
