"""Greedy selection's kernel (kernels/argmax.py) on the GPU at serving shapes: the same index as
torch.argmax for 1, 64 and 256 rows of 128k-152k vocabularies (ties within and across chunks
included), in a CUDA-graph replay too."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels.argmax import BLOCK, argmax_last


@pytest.mark.parametrize("rows,vocab", [(1, 128256), (64, 128256), (256, 151936), (3, 262144)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_kernel_equals_torch(rows, vocab, dtype):
    torch.manual_seed(rows)
    x = (torch.randn(rows, vocab, device="cuda") * 4).to(dtype)
    x[0, 7] = x[0, BLOCK + 7] = x[0].max() + 1  # a tie across chunks: the first wins
    x[-1, -1] = x[-1].max() + 2  # the maximum in the ragged last chunk
    ref = x.argmax(-1)
    assert torch.equal(argmax_last(x), ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_last(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
