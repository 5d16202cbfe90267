"""Decode rows launched longest first (attention/triton_backend.py: launch_order) on the
GPU: the kernel gives the default order's bits inside a CUDA graph, and an engine whose batch is
large enough to take the order gives the same greedy tokens with it on and off."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention import triton_backend
from gpu_worker.kernels.attention_decode import paged_decode
from tests.helpers.checkpoints import build_qwen3
from tests.helpers.inproc import InProcEngine


def test_ordered_decode_in_a_graph_is_bitwise_the_default():
    torch.manual_seed(0)
    bs, hq, hkv, d, ps = 200, 16, 8, 128, 16
    lens = torch.randint(1, 1500, (bs,), device="cuda")
    per_row = 1500 // ps + 1
    kc = torch.randn(bs * per_row * ps + ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    pt = (torch.randperm(bs * per_row, device="cuda") + 1).view(bs, per_row).to(torch.int32)
    slots = torch.arange(bs, device="cuda")
    q = torch.randn(bs, hq, d, device="cuda", dtype=torch.bfloat16)
    order = torch.argsort(lens, descending=True)
    kw = dict(t=1, page_size=ps, scale=d**-0.5, num_splits=1)
    ref = paged_decode(q, kc, vc, pt, slots, lens, lens - 1, **kw)
    paged_decode(q, kc, vc, pt, slots, lens, lens - 1, order=order, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode(q, kc, vc, pt, slots, lens, lens - 1, order=order, **kw)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


def test_engine_tokens_equal_with_and_without_the_order(tmp_path, monkeypatch):
    d = build_qwen3(str(tmp_path / "qwen3"))
    prompts = [[(5 * j + i) % 300 + 6 for j in range(3 + (37 * i) % 120)] for i in range(160)]
    used, real = [], triton_backend.launch_order
    runs = []
    for on in (False, True):
        monkeypatch.setattr(triton_backend, "launch_order",
                            lambda *a: used.append(o := real(*a)) or o if on else None)
        eng = InProcEngine(d, device="cuda", dtype="bfloat16", max_running_requests=160, max_total_tokens=65536)
        for i, p in enumerate(prompts):
            eng.submit(f"r{i}", p, max_new_tokens=16, ignore_eos=True)
        eng.run()
        runs.append([eng.tokens[f"r{i}"] for i in range(len(prompts))])
        del eng
    assert any(o is not None for o in used), "the batch never took the longest-first order"
    assert runs[0] == runs[1]
