"""The greedy tail (``kernels/decode_tail.py``, ``DecodeGraphs.run_tail``) end to end, with the
CUDA-graph decode path emulated on the CPU: a batch switches from the tail to the eager token
selection when a request that needs the eager path (logprobs) joins mid-run, and back when it
leaves, and the slot state both paths write stays one state: every request's tokens equal
HF transformers' greedy tokens."""

from __future__ import annotations

import pytest

from gpu_worker.step.runner import ModelRunner
from tests.helpers.checkpoints import hf_greedy
from tests.helpers.inproc import InProcEngine

pytest.importorskip("triton")
PROMPTS = [[(7 * j + 3 * i) % 370 + 6 for j in range(10 + 5 * i)] for i in range(3)]
NEW = 10


@pytest.mark.parametrize("arch,draft", [("llama", False), ("gemma4", True)])
def test_tail_and_eager_steps_share_one_state(ckpts, monkeypatch, arch, draft):
    monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    paths = []
    real = ModelRunner._greedy_tail
    monkeypatch.setattr(ModelRunner, "_greedy_tail", lambda self, inp: paths.append(r := real(self, inp)) or r)
    model = ckpts[arch]
    eng = InProcEngine(model, draft=ckpts["assistant"] if draft else None, attention_backend="triton", page_size=4,
                       chunked_prefill_size=16, cuda_graph_bs=(2, 4))
    for i, p in enumerate(PROMPTS[:2]):
        eng.submit(f"g{i}", p, max_new_tokens=NEW, ignore_eos=True)
    eng.run(until=lambda: True in paths)  # the tail has written slot state
    tail_steps = len(paths)
    eng.submit("lp", PROMPTS[2], max_new_tokens=3, ignore_eos=True, logprobs=2)  # eager while it runs
    eng.run()
    later = paths[tail_steps:]
    assert False in later and later[-1] is True  # eager steps after tail steps, then the tail again
    for rid, p, n in (("g0", PROMPTS[0], NEW), ("g1", PROMPTS[1], NEW), ("lp", PROMPTS[2], 3)):
        assert eng.tokens[rid] == hf_greedy(model, p, n, ignore_eos=True), rid
