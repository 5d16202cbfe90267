"""The start-up prefill warm-up (gpu_worker/graphs/warmup.py; it runs on CUDA only, these tests call it
on the CPU): it leaves every slot's state and every page but the padding page untouched, and
the engine's tokens afterwards equal HF's."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.graphs.warmup import MIN_TOKENS, prefill_sizes, warm_prefill
from tests.helpers.checkpoints import build_gemma4, build_llama, hf_greedy
from tests.helpers.inproc import InProcEngine

PROMPTS = [[(7 * j + 3 * i) % 370 + 6 for j in range(10 + 5 * i)] for i in range(3)]


def hf_greedy_cpu(ckpt, prompt, n):
    return hf_greedy(ckpt, prompt, n, ignore_eos=True)


def test_prefill_sizes():
    assert prefill_sizes(8192, 131072) == [8192, 2048, 256, MIN_TOKENS]
    assert prefill_sizes(8192, 300) == [300, 256, MIN_TOKENS]  # capped by one slot's pages
    assert prefill_sizes(16, 4096) == []  # no chunk worth warming


def _state(eng):
    st, pool = eng.runner.state, eng.runner.backend.pool
    ps = pool.page_size
    pages = [(k[ps:].clone(), v[ps:].clone()) for k, v in zip(pool.k, pool.v)]  # page 0 excluded
    return st.page_table.clone(), st.seq_len.clone(), st.last_token.clone(), st.hidden.clone(), pages


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_warmup_touches_no_slot_state(tmp_path, arch, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    check_warmup(str(tmp_path / arch), arch, backend, "cpu")


def check_warmup(path: str, arch: str, backend: str, device: str, hf=hf_greedy_cpu) -> None:
    """Also run by tests/gpu on CUDA (where build_runner has already warmed up once)."""
    ckpt = (build_llama if arch == "llama" else build_gemma4)(path)
    eng = InProcEngine(ckpt, attention_backend=backend, page_size=4, chunked_prefill_size=64, device=device,
                       dtype="float32", max_total_tokens=65536)  # on CUDA: not all of the GPU per engine
    for i, p in enumerate(PROMPTS[:2]):  # some real state first, to see it survive
        eng.submit(f"a{i}", p, max_new_tokens=3, ignore_eos=True)
    eng.run()
    before = _state(eng)
    max_tokens = eng.runner.state.page_table.shape[1] * 4
    sizes = prefill_sizes(64, max_tokens)
    assert sizes and sizes[0] == min(64, max_tokens)
    warm_prefill(eng.runner, sizes)
    after = _state(eng)
    for x, y in zip(before[:4], after[:4]):
        assert torch.equal(x, y)
    for (k0, v0), (k1, v1) in zip(before[4], after[4]):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    for i, p in enumerate(PROMPTS):
        eng.submit(f"b{i}", p, max_new_tokens=5, ignore_eos=True)
    eng.run()
    assert [eng.tokens[f"b{i}"] for i in range(len(PROMPTS))] == [hf(ckpt, p, 5) for p in PROMPTS]
