"""The GEMV's fused steps on the GPU at real widths (kernels/gemv.py): down reading the MLP's
activation from the gate_up output, and o_proj / down applying the residual add + RMSNorm in
their last tile (Llama's add-then-norm, Gemma 4's sandwich step with the next norm and the layer
scalar). Each equals the separate kernels (bitwise where the inputs are the same bits), repeats
bitwise inside a CUDA graph, and leaves the tickets clear."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import gemv as G
from gpu_worker.kernels import tickets_clear
from gpu_worker.kernels.activation import gated_act
from gpu_worker.kernels.norm import MODE_ADD_NORM, MODE_NORM_ADD, RowNorm, launch_norm

BF = torch.bfloat16


def _close(a, b):
    torch.testing.assert_close(a.float(), b.float(), rtol=2.0**-7, atol=2e-2)


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("hidden,inter,act", [(4096, 14336, "silu"), (3840, 15360, "gelu_pytorch_tanh")])
def test_down_with_act_and_norm_equals_separate_kernels(m, hidden, inter, act):
    torch.manual_seed(m)
    gu = torch.randn(m, 2 * inter, device="cuda", dtype=BF)
    w = torch.randn(hidden, inter, device="cuda", dtype=BF) * 0.02
    r0 = torch.randn(m, hidden, device="cuda", dtype=BF)
    nw = torch.randn(hidden, device="cuda", dtype=BF)
    plan = G.fused_plan(gu, w, act_in=act, norm=True)
    assert plan is not None and plan["dot"] and plan["splits"] > 1
    h = gated_act(gu[:, :inter], gu[:, inter:], act)
    assert torch.equal(G.gemv(gu, w, act_in=act, **plan), G.gemv(h, w, **plan))
    if hidden == 4096:  # Llama: r' = y + r, out = norm(r')
        r_f, r_u = r0.clone(), r0.clone()
        out = G.gemv(gu, w, act_in=act, norm=RowNorm(MODE_ADD_NORM, r_f, nw, eps=1e-5), **plan)
        ref = launch_norm(MODE_ADD_NORM, G.gemv(h, w, **plan), r_u, nw, None, None, 1e-5, gemma=False)
        assert torch.equal(r_f, r_u)
    else:  # Gemma: r' = (r + norm1(y)) * scale, out = norm2(r')
        scale = torch.tensor([0.3], device="cuda", dtype=BF)
        nw2 = torch.randn(hidden, device="cuda", dtype=BF)
        r_f, r_u = r0.clone(), r0.clone()
        out = G.gemv(gu, w, act_in=act, norm=RowNorm(MODE_NORM_ADD, r_f, nw, nw2, scale, 1e-6, True), **plan)
        ref = launch_norm(MODE_NORM_ADD, G.gemv(h, w, **plan), r_u, nw, nw2, scale, 1e-6, gemma=True)
        _close(r_f, r_u)
    _close(out, ref)
    assert tickets_clear()


@pytest.mark.parametrize("m", [1, 3])
def test_o_proj_norm_in_a_graph_repeats_bitwise(m):
    """Llama's o_proj (the FMA kernel at one row, the tensor-core one at three) with its norm,
    captured once and replayed: every replay gives the eager result, tickets back at 0."""
    torch.manual_seed(7)
    x = torch.randn(m, 4096, device="cuda", dtype=BF)
    w = torch.randn(4096, 4096, device="cuda", dtype=BF) * 0.02
    r0 = torch.randn(m, 4096, device="cuda", dtype=BF)
    nw = torch.randn(4096, device="cuda", dtype=BF)
    plan = G.fused_plan(x, w, norm=True)
    assert plan is not None and bool(plan.get("dot")) == (m > 1)
    r_eager = r0.clone()
    eager = G.gemv(x, w, norm=RowNorm(MODE_ADD_NORM, r_eager, nw, eps=1e-5), **plan)
    ref = launch_norm(MODE_ADD_NORM, G.gemv(x, w, **plan), r0.clone(), nw, None, None, 1e-5, gemma=False)
    _close(eager, ref)
    r = r0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compile outside the capture
        G.gemv(x, w, norm=RowNorm(MODE_ADD_NORM, r, nw, eps=1e-5), **plan)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.gemv(x, w, norm=RowNorm(MODE_ADD_NORM, r, nw, eps=1e-5), **plan)
    for _ in range(3):
        r.copy_(r0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and torch.equal(r, r_eager)
    assert tickets_clear()
