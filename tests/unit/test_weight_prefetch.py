"""L2 warm-up of the next projection's weights (gpu_worker/weight_prefetch.py,
kernels/l2_warm.py): the read kernel against a torch reference under the interpreter, which
weights it reads, the links ``load_model`` makes (each projection points at the one that runs
next, checked by recording real forwards of Llama, Gemma 4 and the assistant), and that the
armed region does nothing off CUDA or switched off, and rejects bad settings."""

from __future__ import annotations

import os
from functools import reduce

import numpy as np
import pytest
import torch

from gpu_worker import weight_prefetch as WP
from gpu_worker.kernels import enable_cpu_kernels
from gpu_worker.models.layers import Linear
from tests.helpers.checkpoints import build_assistant, build_gemma4, build_llama
from tests.helpers.inproc import InProcEngine

L2 = pytest.importorskip("gpu_worker.kernels.l2_warm")


def _xor_chunks(words: torch.Tensor, programs: int, chunk: int) -> list[int]:
    a = words.cpu().numpy()
    return [int(reduce(np.bitwise_xor, a[p * chunk:(p + 1) * chunk], np.int32(0))) for p in range(programs)]


@pytest.mark.parametrize("numel,max_bytes,slots", [(5000, 1 << 30, 4), (3 * 2048 * 2 + 6, 9000, 8), (64, 1 << 20, 16)])
def test_warm_kernel_reads_the_leading_bytes(numel, max_bytes, slots):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs CUDA or TRITON_INTERPRET=1")
        enable_cpu_kernels(True)
    try:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        w = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(torch.bfloat16).to(dev)
        out = torch.full((slots,), -7, dtype=torch.int32, device=dev)
        assert L2.warm_l2(w, max_bytes, out, evict_last=False)
        words = L2.warm_words(w, max_bytes)
        assert words.numel() * 4 == min(max_bytes, numel * 2) // 16 * 16
        programs, chunk = L2.plan(words.numel(), slots)
        assert out[:programs].tolist() == _xor_chunks(words, programs, chunk)
        assert (out[programs:] == -7).all()  # programs past the plan: none launched
    finally:
        enable_cpu_kernels(False)


def test_plan_covers_every_word_once():
    for n in (1, 2047, 2048, 2049, 10**6, 8_388_608):
        for slots in (1, 7, 264):
            programs, chunk = L2.plan(n, slots)
            assert 1 <= programs <= slots and chunk % L2.BLOCK == 0
            assert (programs - 1) * chunk < n <= programs * chunk  # no idle program, nothing missed


def test_ineligible_weights_are_not_read():
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert L2.warm_words(w.t(), 1 << 20) is None  # not contiguous
    assert L2.warm_words(w.reshape(-1)[1:], 1 << 20) is None  # 2-byte offset: misaligned
    assert L2.warm_words(w, 8) is None  # under 16 bytes
    assert L2.warm_words(w, 100).numel() == 96 // 4  # rounded down to 16 bytes
    assert not L2.warm_l2(w, 1 << 20, torch.zeros(4, dtype=torch.int32))  # CPU without the interpreter path
    assert not L2.warm_l2(w, 1 << 20, torch.zeros(4, dtype=torch.int32), evict_last=True)  # prefetches: CUDA only


def _record_calls(model_dirs: dict, monkeypatch, **engine_kw) -> tuple[InProcEngine, list]:
    calls = []
    forward = Linear.forward

    def recording(self, x):
        calls.append(self)
        return forward(self, x)

    monkeypatch.setattr(Linear, "forward", recording)
    eng = InProcEngine(model_dirs["target"], draft=model_dirs.get("draft"), steps=2, page_size=4, **engine_kw)
    eng.submit("a", [5, 6, 7, 8, 9], max_new_tokens=6, ignore_eos=True)
    eng.submit("b", [11, 12, 13], max_new_tokens=4, ignore_eos=True)
    eng.run()
    return eng, calls


def _check_links(model: torch.nn.Module, calls: list) -> None:
    """In every forward of ``model``, each projection's ``prefetch_next`` is the weight of the one
    called right after it (flagged when that one is an attention output projection); the last
    one links to nothing and the next call starts a new forward."""
    named = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    lins = [m for _, m in named]
    o_projs = {id(m) for n, m in named if n.endswith(".o_proj")}
    assert o_projs  # every model here has attention output projections
    mine = {id(m) for m in lins}
    seq = [m for m in calls if id(m) in mine]
    assert seq and lins[-1].prefetch_next is None
    for a, b in zip(seq, seq[1:]):
        if a is lins[-1]:
            assert b is lins[0]
        else:
            assert a.prefetch_next is not None and a.prefetch_next.data_ptr() == b.weight.data_ptr(), (a, b)
            assert a.prefetch_into_o_proj == (id(b) in o_projs)


def test_links_follow_execution_order(tmp_path, monkeypatch):
    llama = build_llama(str(tmp_path / "l"))
    g = build_gemma4(str(tmp_path / "g"))
    a = build_assistant(str(tmp_path / "a"), g)
    eng, calls = _record_calls({"target": llama}, monkeypatch)
    _check_links(eng.runner.target, calls)
    eng, calls = _record_calls({"target": g, "draft": a}, monkeypatch)
    _check_links(eng.runner.target, calls)
    _check_links(eng.runner.assistant, calls)


def test_armed_is_inert_off_cuda_and_when_off(monkeypatch):
    monkeypatch.setenv("TANDEM_L2_PREFETCH_MB", "32,8")
    with WP.armed(torch.device("cpu")) as region:
        assert region is None
        WP.after_projection(torch.zeros(4), 1, True)  # not armed: nothing to fork, no error
    monkeypatch.delenv("TANDEM_L2_PREFETCH_MB")
    assert WP.budgets() == (0, 0)  # off by default
    monkeypatch.setenv("TANDEM_L2_PREFETCH_MB", "16")
    assert WP.budgets() == (16 << 20, 16 << 20)
    monkeypatch.setenv("TANDEM_L2_PREFETCH_MB", "32,4")
    assert WP.budgets() == (32 << 20, 4 << 20)
    assert not WP.evict_last()


@pytest.mark.parametrize("name,value", [("TANDEM_L2_PREFETCH_MB", "-1"), ("TANDEM_L2_PREFETCH_MB", "lots"),
                                        ("TANDEM_L2_PREFETCH_MB", "1,2,3"), ("TANDEM_L2_PREFETCH_MB", "8,"),
                                        ("TANDEM_L2_PREFETCH_EVICT", "first")])
def test_bad_settings_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        WP.budgets() if name.endswith("_MB") else WP.evict_last()


def test_tp_models_are_not_linked(monkeypatch):
    from gpu_worker.parallel import state

    monkeypatch.setattr(state, "tp_size", lambda: 2)
    m = torch.nn.Sequential(Linear(4, 4), Linear(4, 4))
    assert WP.link(m) == 0 and m[0].prefetch_next is None
    monkeypatch.undo()
    assert WP.link(m) == 1 and m[0].prefetch_next.data_ptr() == m[1].weight.data_ptr()
