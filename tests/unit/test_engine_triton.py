"""``--attention-backend triton`` end to end through the scheduler + worker (in-process, CPU,
Triton's interpreter): greedy tokens equal HF transformers for Llama, Qwen3 and Gemma 4 (its
sliding window shorter than the prompt), with frozen-KV MTP, and with the CUDA-graph decode path
emulated (``TANDEM_EMULATE_CUDA_GRAPHS=1``: the same padded bucket buffers, slot-0 padding rows
and device-only metadata that the graphs replay, run eagerly).
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.checkpoints import build_assistant, build_gemma4, build_llama, build_qwen3, hf_greedy
from tests.helpers.inproc import InProcEngine

pytest.importorskip("triton")
# Prompts longer than the Gemma 4 test window (8), of unequal lengths, so decode rows of one
# bucket have different contexts and a bucket has padding rows (3 requests -> bucket 4).
PROMPTS = [[(7 * j + 3 * i) % 370 + 6 for j in range(10 + 5 * i)] for i in range(3)]
NEW = 5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton_engine")
    g = build_gemma4(str(root / "g"))
    return {"llama": build_llama(str(root / "l")), "qwen3": build_qwen3(str(root / "q")), "gemma4": g,
            "assistant": build_assistant(str(root / "a"), g)}


def _run(model, draft=None, **kw):
    eng = InProcEngine(model, draft=draft, attention_backend="triton", page_size=4, chunked_prefill_size=16, **kw)
    for i, p in enumerate(PROMPTS):
        eng.submit(f"r{i}", p, max_new_tokens=NEW, ignore_eos=True)
    eng.run()
    return [eng.tokens[f"r{i}"] for i in range(len(PROMPTS))], eng


@pytest.mark.parametrize("arch,graphs", [("llama", False), ("qwen3", True), ("gemma4", False), ("gemma4", True)])
def test_triton_backend_matches_hf(ckpts, arch, graphs, monkeypatch):
    if graphs:
        monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    got, eng = _run(ckpts[arch], cuda_graph_bs=(1, 2, 4))
    assert (eng.runner.graphs is not None) == graphs
    if graphs:
        assert eng.runner.graphs.sizes == [1, 2, 4]
    assert got == [hf_greedy(ckpts[arch], p, NEW, ignore_eos=True) for p in PROMPTS]


@pytest.mark.parametrize("overlap", [True, False])
def test_triton_backend_mtp_graph_path_is_lossless(ckpts, overlap, monkeypatch):
    monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    got, eng = _run(ckpts["gemma4"], draft=ckpts["assistant"], overlap=overlap, cuda_graph_bs=(2, 4))
    assert eng.runner.graphs is not None and eng.runner.assistant is not None
    assert got == [hf_greedy(ckpts["gemma4"], p, NEW, ignore_eos=True) for p in PROMPTS]
