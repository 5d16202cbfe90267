"""The GEMV norm fusion on the GPU (kernels/gemv.py ``gemv_add`` / ``Prenorm``) at Llama-8B
widths: the residual add in the epilogue is the unfused add to the bit (both kernels), the FMA
kernel's prologue norm with exact sums gives the reference-normed input's result to the bit; a chain of fused projections captured in a
CUDA graph, PDL on and off, gives on fresh inputs every replay the bits of the eager chain; and
an 8B-wide engine decodes, fusion on, what it decodes with the add-norm kernel, up to near-ties."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels import gemv as G
from gpu_worker.kernels import pdl, tickets_clear
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
    o, down, qkv = _w(H, H), _w(H, I), _w(6144, H)
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
    y = G.gemv(r, qkv, prenorm=G.Prenorm(one, nw, EPS), **G.CONFIG)  # the FMA kernel, as at one row
    assert torch.equal(y, G.gemv(_normed_ref(r, one, nw), qkv, **G.CONFIG))
    torch.testing.assert_close(y.float(), F.linear(_normed_ref(r, one, nw), qkv).float(), rtol=2e-2, atol=2e-2)


def _fused_chain(layers, x, r):
    """Projections that hand the stream on un-normed: an FMA consumer norms its input from the
    sums that the producer's epilogue wrote (an FMA o_proj-like and a split-K tensor-core
    down-like producer)."""
    s, sumsq = G.gemv_add(x, layers[0][2], r, **G.plan(x, layers[0][2]))
    for nw, q_w, o_w, up_w, down_w in layers:
        h = G.gemv(s, q_w, prenorm=G.Prenorm(sumsq, nw, EPS), **G.CONFIG)
        a = h[:, :H]
        s, sumsq = G.gemv_add(a, o_w, s, **G.plan(a, o_w))
        u = G.gemv(s, up_w, prenorm=G.Prenorm(sumsq, nw, EPS), **G.CONFIG)
        s, sumsq = G.gemv_add(u, down_w, s, **G.plan(u, down_w))
    return s, sumsq


@pytest.mark.parametrize("pdl_on", [False, True])
def test_fused_chain_in_graph_equals_eager(monkeypatch, pdl_on):
    monkeypatch.setenv("TANDEM_PDL", "1" if pdl_on else "0")
    if pdl_on and not pdl(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs sm90+ and a Triton with gdc_wait")
    torch.manual_seed(1)
    layers = [(1 + 0.02 * torch.randn(H, device="cuda", dtype=BF), _w(6144, H), _w(H, H), _w(I, H), _w(H, I))
              for _ in range(2)]
    xs, rs = (torch.randn(1, H, device="cuda", dtype=BF) for _ in range(2))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _fused_chain(layers, xs.clone(), rs.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_ss = _fused_chain(layers, xs, rs)
    for _ in range(8):
        x1, r1 = (torch.randn(1, H, device="cuda", dtype=BF) for _ in range(2))
        xs.copy_(x1)
        rs.copy_(r1)
        graph.replay()
        got, got_ss = out.clone(), out_ss.clone()
        monkeypatch.setenv("TANDEM_PDL", "0")
        ref, ref_ss = _fused_chain(layers, x1, r1)
        monkeypatch.setenv("TANDEM_PDL", "1" if pdl_on else "0")
        assert torch.equal(got, ref) and torch.equal(got_ss, ref_ss)
    assert tickets_clear()


def test_engine_tokens_track_add_norm_kernel(tmp_path, monkeypatch):
    """Fusion on (default: down adds the residual, qkv norms its input) vs
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
