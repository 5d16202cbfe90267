"""``tandem.LLM`` on CUDA, as users run it: CUDA graphs, overlap depth 3 and frozen-KV MTP, a
batch of token-id prompts whose greedy tokens equal HF transformers' (float32 on the GPU), and
no engine process left after ``shutdown``."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tests.e2e.ops_util import pid_alive
from tests.gpu.test_gpu_parity import PROMPTS, ckpts, hf_greedy_cuda  # noqa: F401 - ckpts is a fixture


@pytest.mark.parametrize("mtp", [False, True])
def test_llm_greedy_equals_hf_on_cuda(ckpts, mtp):  # noqa: F811 - the imported fixture
    d = ckpts["gemma4"]
    spec = dict(speculative_algorithm="FROZEN-KV-MTP", speculative_draft_model_path=ckpts["assistant"]) if mtp else {}
    llm = LLM(d, device="cuda", dtype="float32", chunked_prefill_size=16, max_total_tokens=65536,
              log_level="warning", **spec)
    pids = [p.pid for p in llm._engine.sup.procs.values()]
    try:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS * 8]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        for out, p in zip(outs, PROMPTS * 8):
            assert out.outputs[0].token_ids == hf_greedy_cuda(d, p, 24)
    finally:
        llm.shutdown()
    assert not any(pid_alive(p) for p in pids)
