"""Structured output on CUDA: the worker's masks (host matchers, one upload, the drafts read
back under MTP) inside real CUDA-graph decode steps and the overlap loop give the tokens of HF
transformers' logits (float32 on the GPU) masked by xgrammar itself."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.checkpoints import build_assistant, build_gemma4, build_llama
from tests.helpers.inproc import InProcEngine
from tests.helpers.oracle_draft import BigramDraft, bigram_table
from tests.unit.gpu_worker.structured.grammar_cases import ENDS, PROMPTS
from tests.unit.gpu_worker.structured.test_engine_grammar import _submit_all
from tests.unit.gpu_worker.structured.test_engine_grammar_after import _submit as _submit_after


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_grammar")
    g = build_gemma4(str(root / "g"))
    return build_llama(str(root / "l")), g, build_assistant(str(root / "a"), g)


@pytest.mark.parametrize("mtp,after", [(False, False), (True, False), (True, True)])
def test_grammar_rows_match_the_masked_reference_on_cuda(models, mtp, after):
    """``after``: grammars that bind after a start token (the reasoning end), MTP drafts across it."""
    from transformers import AutoModelForCausalLM

    llama, g, a = models
    target = g if mtp else llama
    eng = InProcEngine(target, draft=a if mtp else None, device="cuda", dtype="float32", page_size=4,
                       attention_backend="triton", max_total_tokens=65536, cuda_graph_bs=(1, 2, 4, 8, 16))
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).cuda().eval()
    refs = _submit_after(eng, target, model=hf)[0] if after else _submit_all(eng, target, model=hf)
    if mtp:  # an oracle draft, captured into the decode graphs again: multi-token steps happen
        eng.runner.assistant = BigramDraft(eng.runner.target, bigram_table([PROMPTS[int(r[-1]) if r[-1].isdigit() else 0]
                                                                            + t for r, t in refs.items()])).cuda()
        eng.runner.enable_graphs([1, 2, 4, 8, 16])
    eng.submit("plain", PROMPTS[1], max_new_tokens=12, ignore_eos=True)
    eng.run()
    for rid, ref in refs.items():
        assert eng.tokens[rid] == ref, rid
        assert eng.finish[rid] == ("stop" if ref[-1] in ENDS else "length"), rid
    if mtp:
        assert eng.core.counters.accepted > 0
