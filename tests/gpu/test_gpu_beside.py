"""``kernels.Beside`` on the GPU: split-K GEMVs (PDL on, tickets) in a block on the second
stream while others run on the caller's stream, eagerly and captured in a CUDA graph (a fork and
a join): every replay gives the sequential launches' results, and every ticket is back at 0."""

from __future__ import annotations

import torch

from gpu_worker.kernels import Beside, tickets_clear
from gpu_worker.kernels import gemv as G


def _pair(x, w1, w2, w3):
    block = Beside(x, on=True)
    with block:
        block.out = G.gemv(G.gemv(x, w1, splits=4, dot=True, block_n=64, block_k=128), w3, splits=2)
    main = G.gemv(x, w2, splits=8, dot=True, block_n=64, block_k=128)
    return block.join(), main


def test_beside_graph_equals_sequential():
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, 2816, device="cuda", generator=g).to(torch.bfloat16)
    w1 = torch.randn(4224, 2816, device="cuda", generator=g).to(torch.bfloat16)
    w2 = torch.randn(8192, 2816, device="cuda", generator=g).to(torch.bfloat16)
    w3 = torch.randn(2816, 4224, device="cuda", generator=g).to(torch.bfloat16)
    want_side = G.gemv(G.gemv(x, w1, splits=4, dot=True, block_n=64, block_k=128), w3, splits=2)
    want_main = G.gemv(x, w2, splits=8, dot=True, block_n=64, block_k=128)
    for _ in range(2):  # eager, concurrent
        side, main = _pair(x, w1, w2, w3)
        assert torch.equal(side, want_side) and torch.equal(main, want_main)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        side, main = _pair(x, w1, w2, w3)
    for _ in range(20):
        side.zero_()
        main.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(side, want_side) and torch.equal(main, want_main)
    assert tickets_clear()
