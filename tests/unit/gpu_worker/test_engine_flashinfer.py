"""``--attention-backend flashinfer`` plumbing on the CPU: our backend drives a stand-in for
flashinfer's wrappers (``tests/helpers/fake_flashinfer.py``: same signatures, torch attention from
exactly the indptr / indices / last-page arrays it is given, and a check that every row's device
length equals the planned one). Greedy tokens must equal HF transformers' through the scheduler
and worker, eager and with the CUDA-graph decode path emulated, with MTP (verify and draft go to
triton) and with Gemma 4's wider global layers on triton per layer. The real kernels are
checked against the same tokens on the GPU (``tests/gpu/test_gpu_parity.py``).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from gpu_worker.attention import flashinfer_backend as fib
from tests.helpers import fake_flashinfer
from tests.helpers.checkpoints import hf_greedy
from tests.helpers.inproc import InProcEngine

pytest.importorskip("triton")
PROMPTS = [[(5 * j + 3 * i) % 370 + 6 for j in range(10 + 6 * i)] for i in range(3)]
NEW = 5


@pytest.fixture
def fake_fi(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    monkeypatch.setattr("gpu_worker.main.resolve_backend", lambda name, dev: "flashinfer")
    # the test models are float32 with 16-dim heads; Gemma 4's 32-dim global layers stay "unsupported"
    monkeypatch.setattr(fib, "FI_DTYPES", fib.FI_DTYPES + (fib.torch.float32,))
    monkeypatch.setattr(fib, "FI_HEAD_DIMS", (16,))


def _run(model, draft=None, **kw):
    eng = InProcEngine(model, draft=draft, attention_backend="triton", page_size=4, chunked_prefill_size=16, **kw)
    assert isinstance(eng.runner.backend, fib.FlashInferBackend)
    for i, p in enumerate(PROMPTS):
        eng.submit(f"r{i}", p, max_new_tokens=NEW, ignore_eos=True)
    eng.run()
    return [eng.tokens[f"r{i}"] for i in range(len(PROMPTS))], eng


def _plans(eng) -> dict[str, int]:
    be = eng.runner.backend
    n = {"prefill": 0, "decode": 0, "graph": 0}
    for (mode, _), p in be._eager.items():
        n[mode] += p.w.plans
    n["graph"] = sum(p.w.plans for g in be._graphs.values() for p in g.wrappers.values())
    return n


@pytest.mark.parametrize("arch,graphs", [("llama", False), ("qwen3", True), ("gemma4", False), ("gemma4", True)])
def test_flashinfer_backend_matches_hf(ckpts, fake_fi, arch, graphs, monkeypatch):
    if graphs:
        monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    got, eng = _run(ckpts[arch], cuda_graph_bs=(1, 2, 4))
    assert got == [hf_greedy(ckpts[arch], p, NEW, ignore_eos=True) for p in PROMPTS]
    n = _plans(eng)
    assert n["prefill"] > 0  # every prefill chunk went through flashinfer's prefill wrapper
    assert (n["graph"] if graphs else n["decode"]) >= NEW - 1  # and decode steps through its decode wrapper


def test_flashinfer_mtp_keeps_verify_and_draft_on_triton(ckpts, fake_fi, monkeypatch):
    monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    got, eng = _run(ckpts["gemma4"], draft=ckpts["assistant"], cuda_graph_bs=(2, 4))
    assert got == [hf_greedy(ckpts["gemma4"], p, NEW, ignore_eos=True) for p in PROMPTS]
    n = _plans(eng)
    assert n["prefill"] > 0 and n["decode"] == 0 and n["graph"] == 0


def test_host_lengths_follow_the_device_without_mtp(ckpts, fake_fi):
    """The host mirror that plans read is the device truth at every launch (overlap depth 2)."""
    eng = InProcEngine(ckpts["qwen3"], attention_backend="triton", page_size=4, chunked_prefill_size=8)
    for i, p in enumerate(PROMPTS):
        eng.submit(f"r{i}", p, max_new_tokens=NEW + 3, ignore_eos=True)
    st, checked = eng.runner.state, 0
    while not eng.core.idle():
        eng.run(until=lambda: True)
        live = [s for s in range(1, len(st.seq_host)) if st.num_pages[s]]
        assert st.seq_host[live].tolist() == st.seq_len[live].tolist()
        checked += len(live)
    assert checked > 0


def test_host_group_arrays():
    g = fib.host_group(np.array([3, 1]), np.array([2, 5]), np.array([9, 4]), tok0=7, page_size=4, max_pages=10)
    assert g.tok0 == 7 and g.tok1 == 11
    assert g.qo_indptr.tolist() == [0, 3, 4] and g.kv_indptr.tolist() == [0, 3, 4]
    assert g.last_page_len.tolist() == [1, 4]
    assert g.flat.tolist() == [20, 21, 22, 50]
    pad = fib.host_group(np.ones(2), np.zeros(2), np.zeros(2), 0, 4, 10)  # padding rows: one key of page 0
    assert pad.kv_indptr.tolist() == [0, 1, 2] and pad.last_page_len.tolist() == [1, 1] and pad.flat.tolist() == [0, 0]
