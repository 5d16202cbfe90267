"""Frozen-KV MTP on CUDA with most drafts accepted: an oracle draft (tests/helpers/oracle_draft.py)
proposes the reference's own continuation, so verify positions 1..S decide tokens. The random
assistant of test_gpu_parity.py almost never has a draft accepted, which leaves those positions
unchecked there.

Why this file (2026-12-05, H100): test_gpu_grammar.py's MTP case gave a token the reference
ranks second by 0.15 logits (not a near-tie), deterministically and with CUDA_LAUNCH_BLOCKING=1;
its plain case and the same test on the CPU (Triton's interpreter, emulated graphs) pass. These
cases take the grammar away and switch the GPU-only parts one at a time: real decode graphs
(none; captured once, with the oracle draft; or captured at start-up and again after the draft
is swapped in, as test_gpu_grammar.py does), PDL (on only for forwards of at most four tokens:
one row of T=4), and one row or many."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_gpu_parity import PROMPTS, hf_greedy_cuda
from tests.helpers.checkpoints import build_assistant, build_gemma4
from tests.helpers.inproc import InProcEngine
from tests.helpers.oracle_draft import BigramDraft, bigram_table

BUCKETS = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_mtp_accept")
    g = build_gemma4(str(root / "g"))
    return g, build_assistant(str(root / "a"), g)


@pytest.mark.parametrize("rows", [1, len(PROMPTS)])
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("graphs", ["recapture", "once", "none"])
def test_accepted_drafts_give_hf_tokens(pair, monkeypatch, graphs, pdl, rows):
    monkeypatch.setenv("TANDEM_PDL", pdl)
    g, a = pair
    kw = dict(cuda_graph_bs=tuple(BUCKETS)) if graphs == "recapture" else dict(disable_cuda_graph=True)
    eng = InProcEngine(g, draft=a, steps=3, device="cuda", dtype="float32", page_size=4,
                       attention_backend="triton", max_total_tokens=65536, **kw)
    prompts = PROMPTS[:rows]
    refs = [hf_greedy_cuda(g, p, 24) for p in prompts]
    eng.runner.assistant = BigramDraft(eng.runner.target, bigram_table([p + r for p, r in zip(prompts, refs)])).cuda()
    if graphs != "none":  # (decode graphs only: "once" has no piecewise prefill graphs)
        eng.runner.enable_graphs(BUCKETS)
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new_tokens=24, ignore_eos=True)
    eng.run()
    for i, ref in enumerate(refs):
        assert eng.tokens[f"r{i}"] == ref, (i, graphs, pdl, rows)
    assert eng.core.counters.accepted > 0
