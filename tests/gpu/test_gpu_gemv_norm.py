"""The GEMV norm fusion on the GPU (kernels/gemv.py ``gemv_add`` / ``Prenorm``) at Llama-8B
widths: the residual add in the epilogue is the unfused add to the bit, the prologue norm with
exact sums is the norm kernel's input to the bit; a chain of fused projections captured in a
CUDA graph, PDL on and off, gives on fresh inputs every replay the bits of the eager chain; and
an 8B-wide engine decodes, fusion on, what it decodes with the add-norm kernel, up to near-ties."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels import gemv as G
from gpu_worker.kernels import pdl, tickets_clear
from gpu_worker.kernels.activation import gated_act
from tests.gpu.test_gpu_decode_chain import PROMPTS, _llama_8b_width, _run
from tests.helpers.inproc import top_alternatives

H, I, EPS = 4096, 14336, 1e-5
BF = torch.bfloat16


def _w(*shape):
    return 0.02 * torch.randn(*shape, device="cuda", dtype=BF)


def _normed_ref(r, sumsq, w):
    inv = 1.0 / torch.sqrt(sumsq.sum(-1, keepdim=True) / r.shape[-1] + EPS)
    return (w.float() * (r.float() * inv).to(BF).float()).to(BF)


@pytest.mark.parametrize("m", [1, 4])
def test_fused_projections_match_unfused_at_llama_width(m):
    torch.manual_seed(0)
    o, down, qkv, gu = _w(H, H), _w(H, I), _w(6144, H), _w(2 * I, H)
    r = torch.randn(m, H, device="cuda", dtype=BF)
    for x, w in ((torch.randn(m, H, device="cuda", dtype=BF), o), (torch.randn(m, I, device="cuda", dtype=BF), down)):
        cfg = G.plan(x, w)
        assert cfg is not None
        s, sumsq = G.gemv_add(x, w, r, **cfg)
        assert torch.equal(s, (G.gemv(x, w, **cfg).float() + r.float()).to(BF))
        torch.testing.assert_close(sumsq.sum(-1), (s.float() ** 2).sum(-1), rtol=1e-4, atol=1e-3)
        assert tickets_clear()
    nw = 1 + 0.1 * torch.randn(H, device="cuda", dtype=BF)
    one = (r.double() ** 2).sum(-1, keepdim=True).float()
    for w in (qkv, gu):
        cfg = G.plan(r, w)
        y = G.gemv(r, w, prenorm=G.Prenorm(one, nw, EPS), **cfg)
        assert torch.equal(y, G.gemv(_normed_ref(r, one, nw), w, **cfg))
        torch.testing.assert_close(y.float(), F.linear(_normed_ref(r, one, nw), w).float(), rtol=2e-2, atol=2e-2)


def _fused_chain(layers, x, r, act_in):
    """Llama's MLP blocks with the norm fusion: gate_up norms in its prologue, down adds in its
    epilogue (``act_in``: reading the activation from gate_up's output); the first block's sums
    come from an o_proj-like gemv_add."""
    o_w = layers[0][3]
    s, sumsq = G.gemv_add(x, o_w, r, **G.plan(x, o_w))
    for nw, gu_w, down_w, _ in layers:
        h = G.gemv(s, gu_w, prenorm=G.Prenorm(sumsq, nw, EPS), **G.plan(s, gu_w))
        if act_in:
            s, sumsq = G.gemv_add(h, down_w, s, act_in="silu", **G.plan(h[:, :I], down_w))
        else:
            a = gated_act(h[:, :I], h[:, I:], "silu")
            s, sumsq = G.gemv_add(a, down_w, s, **G.plan(a, down_w))
    return s, sumsq


@pytest.mark.parametrize("m", [1, 4])
def test_act_in_equals_activation_kernel_at_llama_width(m):
    torch.manual_seed(2)
    h, down, r = torch.randn(m, 2 * I, device="cuda", dtype=BF), _w(H, I), torch.randn(m, H, device="cuda", dtype=BF)
    cfg = G.plan(h[:, :I], down)
    fused = G.gemv_add(h, down, r, act_in="silu", **cfg)
    unfused = G.gemv_add(gated_act(h[:, :I], h[:, I:], "silu"), down, r, **cfg)
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])


@pytest.mark.parametrize("act_in", [False, True])
@pytest.mark.parametrize("pdl_on", [False, True])
def test_fused_chain_in_graph_equals_eager(monkeypatch, pdl_on, act_in):
    monkeypatch.setenv("TANDEM_PDL", "1" if pdl_on else "0")
    if pdl_on and not pdl(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs sm90+ and a Triton with gdc_wait")
    torch.manual_seed(1)
    layers = [(1 + 0.02 * torch.randn(H, device="cuda", dtype=BF), _w(2 * I, H), _w(H, I), _w(H, H))
              for _ in range(3)]
    xs, rs = (torch.randn(1, H, device="cuda", dtype=BF) for _ in range(2))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _fused_chain(layers, xs.clone(), rs.clone(), act_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_ss = _fused_chain(layers, xs, rs, act_in)
    for _ in range(8):
        x1, r1 = (torch.randn(1, H, device="cuda", dtype=BF) for _ in range(2))
        xs.copy_(x1)
        rs.copy_(r1)
        graph.replay()
        got, got_ss = out.clone(), out_ss.clone()
        monkeypatch.setenv("TANDEM_PDL", "0")
        ref, ref_ss = _fused_chain(layers, x1, r1, act_in)
        monkeypatch.setenv("TANDEM_PDL", "1" if pdl_on else "0")
        assert torch.equal(got, ref) and torch.equal(got_ss, ref_ss)
    assert tickets_clear()


def test_engine_tokens_track_add_norm_kernel(tmp_path, monkeypatch):
    """Fusions on (default: the norm in the prologue, the add and the activation in down) vs
    ``TANDEM_GEMV_FUSE_NORM=0``: the same greedy tokens up to a row's first differing token,
    which must be a near-tie (the 1 / RMS sums in another order)."""
    d = _llama_8b_width(str(tmp_path), 14336)
    engines = []
    for on in ("1", "0"):
        monkeypatch.setenv("TANDEM_GEMV_FUSE_NORM", on)
        engines.append(_run(d, overlap=True, logprobs=2))
    fused, plain = engines
    for i in range(len(PROMPTS)):
        got, want, top = fused.tokens[f"r{i}"], plain.tokens[f"r{i}"], top_alternatives(fused, f"r{i}")
        assert len(got) == len(want) == len(top) == 24
        k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if k is not None:
            assert want[k] in top[k] and abs(top[k][got[k]] - top[k][want[k]]) < 0.05, (i, k, top[k])
