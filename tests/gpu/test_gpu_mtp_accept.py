"""Frozen-KV MTP on CUDA with most drafts accepted: an oracle draft (tests/helpers/oracle_draft.py)
proposes the reference's own continuation, so verify positions 1..S decide tokens. The random
assistant of test_gpu_parity.py almost never has a draft accepted, which leaves those positions
unchecked there. The GPU-only parts are switched one at a time (``SETUPS``), one row or many."""

from __future__ import annotations

import pytest

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


# How the engine's graphs come to be, the oracle draft swapped in after start-up: "none" (no
# graphs), "both" (decode then piecewise prefill graphs captured once, after the swap: start-up's
# order), "recapture" (start-up's graphs, then the swap and the decode graphs captured again:
# test_gpu_grammar.py's path). "recapture" checks that a ``.cuda()`` of a model already in place
# (``BigramDraft(target).cuda()`` moves the target it holds) replaces no tensor the graphs
# captured before it read (``Rotary._apply``; tests/unit/gpu_worker/models/test_rotary_apply.py is the CPU twin).
SETUPS = ["none", "both", "recapture"]


def _engine(g, a, setup):
    kw = dict(cuda_graph_bs=tuple(BUCKETS)) if setup == "recapture" else dict(disable_cuda_graph=True)
    return InProcEngine(g, draft=a, steps=3, device="cuda", dtype="float32", page_size=4,
                        attention_backend="triton", max_total_tokens=65536, **kw)


@pytest.mark.parametrize("rows", [1, len(PROMPTS)])
@pytest.mark.parametrize("setup", SETUPS)
def test_accepted_drafts_give_hf_tokens(pair, setup, rows):
    g, a = pair
    eng = _engine(g, a, setup)
    prompts = PROMPTS[:rows]
    refs = [hf_greedy_cuda(g, p, 24) for p in prompts]
    eng.runner.assistant = BigramDraft(eng.runner.target, bigram_table([p + r for p, r in zip(prompts, refs)])).cuda()
    if setup != "none":
        eng.runner.enable_graphs(BUCKETS)
    if setup == "both":
        eng.runner.enable_prefill_graphs(8192)
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new_tokens=24, ignore_eos=True)
    eng.run()
    for i, ref in enumerate(refs):
        assert eng.tokens[f"r{i}"] == ref, (i, setup, rows, eng.tokens[f"r{i}"], ref)
    assert eng.core.counters.accepted > 0
