"""The greedy tail (``kernels/decode_tail.py``, ``DecodeGraphs.run_tail``) end to end, with the
CUDA-graph decode path emulated on the CPU: a batch switches between the tail and the eager
token selection as requests that need the eager path (logprobs, sampling) join and leave, and
the slot state both paths write stays one state — every request's tokens equal those of a run
with the tail switched off, and greedy requests' tokens equal HF transformers'."""

from __future__ import annotations

import pytest

from gpu_worker.runner import ModelRunner
from tests.helpers.checkpoints import build_engine_set, hf_greedy
from tests.helpers.inproc import InProcEngine

pytest.importorskip("triton")
PROMPTS = [[(7 * j + 3 * i) % 370 + 6 for j in range(10 + 5 * i)] for i in range(2)]
NEW = 10


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_engine_set(tmp_path_factory.mktemp("tail_engine"))


def _run(model, draft, monkeypatch, tail: bool):
    monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    monkeypatch.setenv("TANDEM_GREEDY_TAIL", "1" if tail else "0")
    paths = []
    real = ModelRunner._greedy_tail
    monkeypatch.setattr(ModelRunner, "_greedy_tail", lambda self, rows, b: paths.append(r := real(self, rows, b)) or r)
    eng = InProcEngine(model, draft=draft, attention_backend="triton", page_size=4, chunked_prefill_size=16,
                       cuda_graph_bs=(2, 4))
    for i, p in enumerate(PROMPTS):
        eng.submit(f"g{i}", p, max_new_tokens=NEW, ignore_eos=True)
    # short-lived requests that need the eager path: logprobs, and a seeded sampled one
    eng.submit("lp", PROMPTS[0], max_new_tokens=2, ignore_eos=True, logprobs=2)
    eng.submit("s", PROMPTS[1], max_new_tokens=2, ignore_eos=True, temperature=0.8, seed=7)
    eng.run()
    return {rid: list(t) for rid, t in eng.tokens.items()}, paths


@pytest.mark.parametrize("arch,draft", [("llama", False), ("gemma4", True)])
def test_tail_and_eager_steps_share_one_state(ckpts, monkeypatch, arch, draft):
    model, assistant = ckpts[arch], ckpts["assistant"] if draft else None
    with_tail, paths = _run(model, assistant, monkeypatch, tail=True)
    assert True in paths and False in paths  # both paths ran, in one engine, for the same slots
    without, _ = _run(model, assistant, monkeypatch, tail=False)
    assert with_tail == without
    for i, p in enumerate(PROMPTS):
        assert with_tail[f"g{i}"] == hf_greedy(model, p, NEW, ignore_eos=True)
