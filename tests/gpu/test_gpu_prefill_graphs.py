"""Piecewise prefill graphs captured and replayed on CUDA: greedy tokens equal HF's (float32) for
prefill steps of many sizes (padded into buckets 16 / 32 / 48), with and without MTP and
overlap, and padding tokens never write a live request's KV."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.graphs.prefill import PrefillGraphs
from tests.gpu.test_gpu_parity import ckpts, hf_greedy_cuda  # noqa: F401  (fixture)
from tests.helpers.inproc import InProcEngine

LENGTHS = (3, 17, 70, 30, 9)


@pytest.mark.parametrize("arch,mtp,overlap", [("llama", False, True), ("qwen3", False, False),
                                              ("gemma4", True, True)])
def test_piecewise_prefill_matches_hf(ckpts, arch, mtp, overlap, monkeypatch):  # noqa: F811
    d = ckpts[arch]
    eng = InProcEngine(d, draft=ckpts["assistant"] if mtp else None, steps=3, overlap=overlap, device="cuda",
                       dtype="float32", chunked_prefill_size=48, max_total_tokens=65536)
    pg = eng.runner.prefill
    assert pg is not None and pg.capture_graphs and sorted(pg.buckets) == [16, 32, 48]
    seen = []
    real = PrefillGraphs.forward
    monkeypatch.setattr(PrefillGraphs, "forward",
                        lambda self, fb: seen.append((fb.num_tokens, self.bucket(fb.num_tokens))) or real(self, fb))
    prompts = [[(5 * j + 7 * i) % 300 + 6 for j in range(n)] for i, n in enumerate(LENGTHS)]
    for group in ((0, 1, 2), (3,), (4,)):
        for i in group:
            eng.submit(f"r{i}", prompts[i], max_new_tokens=12, ignore_eos=True)
        eng.run()
    assert {b for _, b in seen} == {16, 32, 48} and any(n < b for n, b in seen)
    for i, p in enumerate(prompts):
        assert eng.tokens[f"r{i}"] == hf_greedy_cuda(d, p, 12), (arch, i)


def test_padding_writes_page_zero_only_cuda(ckpts):  # noqa: F811
    d = ckpts["llama"]
    eng = InProcEngine(d, device="cuda", dtype="float32", page_size=4, chunked_prefill_size=48,
                       max_total_tokens=65536)
    a = [(3 * j) % 300 + 9 for j in range(20)]
    eng.submit("a", a, max_new_tokens=8, ignore_eos=True)
    eng.run(until=lambda: len(eng.tokens["a"]) >= 2)
    pt = eng.runner.state.page_table.cpu()
    slot = next(i for i in range(1, pt.shape[0]) if int(pt[i, 0]) != 0)
    loc = int(pt[slot, 1]) * 4 + 1
    pool = eng.runner.backend.pool
    before = [pool.k[i][loc].clone() for i in range(len(pool.k))]
    eng.runner.prefill.loc.fill_(loc)  # stale locations, as a larger earlier step leaves them
    eng.submit("b", [5, 6, 7], max_new_tokens=3, ignore_eos=True)
    eng.run()
    torch.cuda.synchronize()
    assert all(torch.equal(pool.k[i][loc], before[i]) for i in range(len(pool.k)))
    assert eng.tokens["a"] == hf_greedy_cuda(d, a, 8)
    assert eng.tokens["b"] == hf_greedy_cuda(d, [5, 6, 7], 3)
