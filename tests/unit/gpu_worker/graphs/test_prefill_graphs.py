"""Piecewise prefill graphs (``gpu_worker/graphs/prefill.py``) on the CPU: the padded bucket path
they replay, run eagerly (``TANDEM_EMULATE_CUDA_GRAPHS=1``) through the Triton kernels under the
interpreter. Greedy tokens equal HF's for every prefill step size (padding in most of them),
with MTP, and padding tokens never write a real row's KV.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.graphs.prefill import PrefillGraphs, prefill_buckets
from tests.helpers.checkpoints import hf_greedy
from tests.helpers.inproc import InProcEngine

pytest.importorskip("triton")
NEW = 4


def test_buckets_cover_the_step_budget():
    assert prefill_buckets(8192) == [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 3584, 4096,
                                     5120, 6144, 7168, 8192]
    assert prefill_buckets(48) == [16, 32, 48]
    assert prefill_buckets(100) == [16, 32, 64, 112]  # rounded up to a multiple of 16
    assert prefill_buckets(16384)[-3:] == [14336, 15360, 16384]
    for top in (16, 100, 8192, 16384):
        sizes = prefill_buckets(top)
        assert sizes == sorted(set(sizes)) and sizes[-1] >= top and all(s % 16 == 0 for s in sizes)


def _engine(model, monkeypatch, draft=None, **kw):
    monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    return InProcEngine(model, draft=draft, attention_backend="triton", page_size=4, chunked_prefill_size=48, **kw)


@pytest.mark.parametrize("arch,draft", [("llama", False), ("gemma4", True)])
def test_every_prefill_step_size_matches_hf(ckpts, arch, draft, monkeypatch):
    """Prompts of 3 to 70 tokens (70 is chunked over two steps): three together, then two alone,
    so steps of many sizes land in buckets 16 / 32 / 48, padded; decode rows ride along."""
    eng = _engine(ckpts[arch], monkeypatch, draft=ckpts["assistant"] if draft else None)
    assert eng.runner.prefill is not None and eng.runner.prefill.sizes == [16, 32, 48]
    seen = []
    real = PrefillGraphs.forward
    monkeypatch.setattr(PrefillGraphs, "forward",
                        lambda self, fb: seen.append((fb.num_tokens, self.bucket(fb.num_tokens))) or real(self, fb))
    prompts = [[(5 * j + 7 * i) % 370 + 6 for j in range(n)] for i, n in enumerate((3, 17, 70, 30, 9))]
    for group in ((0, 1, 2), (3,), (4,)):
        for i in group:
            eng.submit(f"r{i}", prompts[i], max_new_tokens=NEW, ignore_eos=True)
        eng.run()
    assert any(n < b for n, b in seen) and {b for _, b in seen} == {16, 32, 48}
    assert [eng.tokens[f"r{i}"] for i in range(len(prompts))] == \
        [hf_greedy(ckpts[arch], p, NEW, ignore_eos=True) for p in prompts]


def test_padding_writes_page_zero_only(ckpts, monkeypatch):
    """Stale KV locations left in the static buffer (as a larger earlier step would) must not
    be where padding tokens write: the step zeroes them, so a live request's keys survive."""
    eng = _engine(ckpts["llama"], monkeypatch)
    a = [(3 * j) % 300 + 9 for j in range(20)]
    eng.submit("a", a, max_new_tokens=8, ignore_eos=True)
    eng.run(until=lambda: len(eng.tokens["a"]) >= 2)  # "a" is decoding
    pt = eng.runner.state.page_table
    slot = next(i for i in range(1, pt.shape[0]) if int(pt[i, 0]) != 0)
    loc = int(pt[slot, 1]) * 4 + 1  # one of a's keys
    pool = eng.runner.backend.pool
    before = [pool.k[i][loc].clone() for i in range(len(pool.k))]
    eng.runner.prefill.loc.fill_(loc)
    b = [5, 6, 7]
    eng.submit("b", b, max_new_tokens=3, ignore_eos=True)
    eng.run()
    assert all(torch.equal(pool.k[i][loc], before[i]) for i in range(len(pool.k)))
    assert eng.tokens["a"] == hf_greedy(ckpts["llama"], a, 8, ignore_eos=True)
    assert eng.tokens["b"] == hf_greedy(ckpts["llama"], b, 3, ignore_eos=True)


def test_off_by_flag_and_for_the_torch_backend(ckpts, monkeypatch):
    monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    assert _engine(ckpts["llama"], monkeypatch, disable_piecewise_cuda_graph=True).runner.prefill is None
    eng = InProcEngine(ckpts["llama"], attention_backend="torch", page_size=4, chunked_prefill_size=48)
    assert eng.runner.prefill is None
