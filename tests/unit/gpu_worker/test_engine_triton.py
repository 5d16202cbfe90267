"""``--attention-backend triton`` end to end through the scheduler + worker (in-process, CPU,
Triton's interpreter): greedy tokens equal HF transformers for Llama, Qwen3 and Gemma 4 (its
sliding window shorter than the prompt), with frozen-KV MTP, and with the CUDA-graph decode path
emulated (``TANDEM_EMULATE_CUDA_GRAPHS=1``: the same padded bucket buffers, slot-0 padding rows
and device-only metadata that the graphs replay, run eagerly).
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.checkpoints import hf_greedy
from tests.helpers.inproc import InProcEngine

pytest.importorskip("triton")

pytestmark = pytest.mark.heavy  # minutes of work: started first (tests/conftest.py)
# Prompts longer than the Gemma 4 test window (8), of unequal lengths, so decode rows of one
# bucket have different contexts and a bucket has padding rows (3 requests -> bucket 4).
PROMPTS = [[(7 * j + 3 * i) % 370 + 6 for j in range(10 + 5 * i)] for i in range(3)]
NEW = 5


@pytest.fixture
def launch_orders(monkeypatch):
    """The decode launch orders the backend chose (None: the default order). The prompts' 3 rows
    x 2 KV heads are more programs than the interpreter's 2 "SMs" hold twice, so decode rows
    launch longest first, on the graph and eager paths and for the draft's read too."""
    from gpu_worker.attention import triton_backend

    orders = []
    real = triton_backend.launch_order
    monkeypatch.setattr(triton_backend, "launch_order", lambda *a: orders.append(o := real(*a)) or o)
    return orders


def _run(model, draft=None, **kw):
    eng = InProcEngine(model, draft=draft, attention_backend="triton", page_size=4, chunked_prefill_size=16, **kw)
    for i, p in enumerate(PROMPTS):
        eng.submit(f"r{i}", p, max_new_tokens=NEW, ignore_eos=True)
    eng.run()
    return [eng.tokens[f"r{i}"] for i in range(len(PROMPTS))], eng


@pytest.mark.parametrize("arch,graphs", [("llama", False), ("qwen3", True), ("gemma4", False), ("gemma4", True)])
def test_triton_backend_matches_hf(ckpts, arch, graphs, monkeypatch, launch_orders):
    """HF's tokens, with the decode rows launched longest first."""
    if graphs:
        monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    got, eng = _run(ckpts[arch], cuda_graph_bs=(1, 2, 4))
    assert (eng.runner.graphs is not None) == graphs
    if graphs:
        assert eng.runner.graphs.sizes == [1, 2, 4]
    assert any(o is not None for o in launch_orders)
    assert got == [hf_greedy(ckpts[arch], p, NEW, ignore_eos=True) for p in PROMPTS]


@pytest.mark.parametrize("overlap", [True, False])
def test_triton_backend_mtp_graph_path_is_lossless(ckpts, overlap, monkeypatch):
    monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    got, eng = _run(ckpts["gemma4"], draft=ckpts["assistant"], overlap=overlap, cuda_graph_bs=(2, 4))
    assert eng.runner.graphs is not None and eng.runner.assistant is not None
    assert got == [hf_greedy(ckpts["gemma4"], p, NEW, ignore_eos=True) for p in PROMPTS]


def test_mtp_graph_path_launches_longest_first(ckpts, monkeypatch, launch_orders):
    """With MTP on the graph path (3 rows in bucket 4), verify's and the draft's attention reads
    launch longest first too: still HF's tokens."""
    monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    got, _ = _run(ckpts["gemma4"], draft=ckpts["assistant"], cuda_graph_bs=(4,))
    assert any(o is not None for o in launch_orders)
    assert got == [hf_greedy(ckpts["gemma4"], p, NEW, ignore_eos=True) for p in PROMPTS]


@pytest.mark.parametrize("arch,draft", [("qwen3", False), ("gemma4", True)])
def test_short_prompts_take_the_extend_kernel(ckpts, arch, draft, monkeypatch):
    """Prompts of a few tokens, alone or beside others: the decode kernel only ever runs with
    the engine's decode query counts (1; S+1 = 4 with MTP), so no short prompt builds a new
    variant of it while serving; tokens still HF's."""
    from gpu_worker.attention import triton_backend

    ts = set()
    real = triton_backend.paged_decode
    monkeypatch.setattr(triton_backend, "paged_decode", lambda *a, **kw: ts.add(kw["t"]) or real(*a, **kw))
    prompts = [[11, 12, 13], [7] * 8, [300], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    eng = InProcEngine(ckpts[arch], draft=ckpts["assistant"] if draft else None, attention_backend="triton",
                       page_size=4, chunked_prefill_size=16)
    for i, p in enumerate(prompts):  # one at a time: each short prompt alone in its step
        eng.submit(f"r{i}", p, max_new_tokens=NEW, ignore_eos=True)
        eng.run()
    assert ts <= ({1, 4} if draft else {1}) and 1 in ts
    assert [eng.tokens[f"r{i}"] for i in range(len(prompts))] == \
        [hf_greedy(ckpts[arch], p, NEW, ignore_eos=True) for p in prompts]


def test_graph_path_keeps_penalties_min_tokens_and_seeds(ckpts, monkeypatch):
    """Token selection runs after the replay: the graph path gives the eager path's tokens for
    penalised, min_tokens and seeded-sampling requests, with MTP and overlap."""
    reqs = [dict(max_new_tokens=NEW, repetition_penalty=1.3, frequency_penalty=0.5, min_new_tokens=NEW),
            dict(max_new_tokens=NEW, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)]

    def run(graphs: bool):
        if graphs:
            monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
        else:
            monkeypatch.delenv("TANDEM_EMULATE_CUDA_GRAPHS", raising=False)
        eng = InProcEngine(ckpts["gemma4"], draft=ckpts["assistant"], attention_backend="triton", page_size=4,
                           cuda_graph_bs=(2,))
        assert (eng.runner.graphs is not None) == graphs
        for i, (p, kw) in enumerate(zip(PROMPTS, reqs)):
            eng.submit(f"r{i}", p, **kw)
        eng.run()
        return [eng.tokens[f"r{i}"] for i in range(len(reqs))]

    eager, graphed = run(False), run(True)
    assert graphed == eager and all(len(t) == NEW for t in eager)
