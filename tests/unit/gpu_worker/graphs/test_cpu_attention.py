"""The compiled CPU steps' decode attention (``graphs/cpu_attention.py``) reads what the torch
backend reads: the same outputs for decode (t = 1), MTP verify (t = 4) and the frozen-KV draft's
Q-only read, on full and sliding layers, with rows of unequal lengths over scattered pages, and a
key bound past the longest row; as tensor ops and through the library's kernel reading the pool
in place (``fused``: ``cpu_attn.cpp``, on the caller's thread and shared with the helper). (Run
eagerly here; the programs trace this same code.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.attention.base import RowLayout
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.forward_batch import AttnLayer, ForwardBatch
from gpu_worker.graphs import cpu_ops
from gpu_worker.graphs.cpu_attention import CpuDecodeAttention
from gpu_worker.kv_pool import KVLayerShape, KVPool

PAGE, WINDOW, HQ, HKV, D = 4, 6, 4, 2, 8


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pool = KVPool([KVLayerShape(HKV, D)], 40, PAGE, torch.float32, "cpu")
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    pages = torch.randperm(39, generator=g)[:30] + 1  # scattered, never page 0
    table = torch.zeros(5, 10, dtype=torch.int32)
    table[1:4] = pages.view(3, 10).int()
    return pool, table


@pytest.fixture(params=["ops", "fused", "fused-2-threads"])
def fused(request) -> bool:
    """Which attention a test's ``CpuDecodeAttention`` runs."""
    if request.param == "ops":
        return False
    request.getfixturevalue("lib")
    if request.param == "fused-2-threads":
        cpu_ops.gemm_threads(2)
        request.addfinalizer(lambda: cpu_ops.gemm_threads(1))
    return True


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("t,draft", [(1, False), (4, False), (1, True)])
def test_reads_equal_the_torch_backend(window, t, draft, fused):
    pool, table = _setup()
    slots = torch.tensor([2, 1, 3])
    seq = torch.tensor([13, 1, 25])  # committed lengths
    kv_lens = seq if draft else seq + t
    q_pos = (kv_lens - 1) if draft else (seq[:, None] + torch.arange(t)[None, :]).reshape(-1)
    q = torch.randn(3 * t, HQ, D, generator=torch.Generator().manual_seed(1))
    layer = AttnLayer(kv_layer=0, sliding_window=window, scaling=0.3, writes_kv=False)

    ref_backend = TorchAttentionBackend(pool, table)
    layout = RowLayout(slots=slots, q_lens=np.full(3, t), kv_lens=kv_lens, kv_bound=kv_lens.numpy(), q_pos=q_pos)
    ref = ref_backend.forward(layer, q, None, None, ForwardBatch(None, q_pos, None, ref_backend.build(
        layout, (WINDOW,)), 3 * t))

    cpu = CpuDecodeAttention(pool, table, fused)
    cpu.kv_cols = torch.arange(32)  # past the longest row: the mask, not the bound, decides
    meta = cpu.decode_meta(slots, kv_lens, q_pos, t)
    got = cpu.forward(layer, q, None, None, ForwardBatch(None, q_pos, None, meta, 3 * t))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_writes_then_reads_its_own_keys(fused):
    """A target layer stores its tokens' KV at ``out_loc`` before reading: each query sees itself."""
    pool, table = _setup()
    cpu = CpuDecodeAttention(pool, table, fused)
    cpu.kv_cols = torch.arange(16)
    slots, seq, t = torch.tensor([1]), torch.tensor([5]), 2
    pos = seq + torch.arange(t)
    loc = table[1, pos // PAGE].long() * PAGE + pos % PAGE
    k, v = torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    layer = AttnLayer(kv_layer=0, sliding_window=None, scaling=1.0)
    q = torch.randn(t, HQ, D)
    meta = cpu.decode_meta(slots, seq + t, pos, t)
    got = cpu.forward(layer, q, k, v, ForwardBatch(None, pos, loc, meta, t))
    torch.testing.assert_close(pool.k[0][loc], k)
    torch.testing.assert_close(pool.v[0][loc], v)
    assert torch.isfinite(got).all()


def test_a_row_with_no_keys_stays_finite(fused):
    """A padding row (slot 0, length 0) under the draft's mask sees nothing: no NaN leaves it."""
    pool, table = _setup()
    cpu = CpuDecodeAttention(pool, table, fused)
    cpu.kv_cols = torch.arange(8)
    zero = torch.tensor([0])
    meta = cpu.decode_meta(torch.tensor([0]), zero, zero - 1, 1)
    layer = AttnLayer(kv_layer=0, sliding_window=WINDOW, scaling=1.0, writes_kv=False)
    out = cpu.forward(layer, torch.randn(1, HQ, D), None, None, ForwardBatch(None, zero, None, meta, 1))
    assert torch.isfinite(out).all()
