"""``kernels.Beside``: a block of launches on a second stream. Its split kernels take their own
ticket buffer (two split-K GEMVs may run at once, one a stream), its result is the in-place
result, and ``join`` hands it back. On the CPU the block runs in place, with the second buffer."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import kernels
from gpu_worker.kernels import Beside, tickets, tickets_clear
from gpu_worker.kernels import gemv as G

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_beside_takes_its_own_tickets():
    dev = torch.device(DEV, 0) if DEV == "cuda" else torch.device("cpu")
    main = tickets(dev)
    block = Beside(torch.zeros(1, device=dev), on=True)
    with block:
        side = tickets(dev)
    assert side.data_ptr() != main.data_ptr() and side.shape == main.shape
    assert tickets(dev).data_ptr() == main.data_ptr()  # back on the caller's buffer after the block
    assert block.join() is None and block.keep == ()


@pytest.mark.parametrize("on", [False, True])
def test_split_gemv_beside_equals_in_place(on):
    """A split-K GEMV in the block while another runs on the caller's stream: both equal the
    same launches one after the other, and every ticket is back at 0."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 512, generator=g).to(torch.bfloat16).to(DEV)
    w1 = torch.randn(48, 512, generator=g).to(torch.bfloat16).to(DEV)
    w2 = torch.randn(40, 512, generator=g).to(torch.bfloat16).to(DEV)
    want1 = G.gemv(x, w1, splits=4, block_n=16, block_k=64, dot=True)
    want2 = G.gemv(x, w2, splits=4, block_n=16, block_k=64, dot=True)
    block = Beside(x, on=on)
    with block:
        block.out = G.gemv(x, w1, splits=4, block_n=16, block_k=64, dot=True)
    got2 = G.gemv(x, w2, splits=4, block_n=16, block_k=64, dot=True)
    got1 = block.join()
    assert torch.equal(got1, want1) and torch.equal(got2, want2)
    assert not kernels._BESIDE[0] and tickets_clear()
