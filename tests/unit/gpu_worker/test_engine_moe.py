"""Mixture-of-experts targets through the scheduler + worker (in-process, CPU): greedy tokens
equal HF transformers for Gemma 4 with its MoE block and for Qwen3-MoE; with a frozen-KV MTP
assistant on the Gemma 4 MoE target, MTP == plain == HF with overlap on and off; and the same
under ``--attention-backend triton`` (the MoE kernels under Triton's interpreter) with the
CUDA-graph decode path emulated (``TANDEM_EMULATE_CUDA_GRAPHS=1``)."""

from __future__ import annotations

import pytest

from tests.helpers.checkpoints import build_assistant, build_gemma4_moe, build_qwen3_moe, hf_greedy
from tests.helpers.inproc import InProcEngine
from tests.helpers.oracle_draft import BigramDraft, bigram_table

# Unequal lengths, longer than the Gemma 4 test window (8): 3 requests take graph bucket 4 (a
# padding row); the first is alone for its first steps (1-token experts), then 3 rows together.
PROMPTS = [[(7 * j + 3 * i) % 370 + 6 for j in range(10 + 6 * i)] for i in range(3)]
NEW = 6


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_engine")
    g = build_gemma4_moe(str(root / "g"))
    return {"gemma4_moe": g, "qwen3_moe": build_qwen3_moe(str(root / "q")),
            "assistant": build_assistant(str(root / "a"), g)}


@pytest.fixture(scope="module")
def refs(ckpts):
    return {arch: [hf_greedy(ckpts[arch], p, NEW, ignore_eos=True) for p in PROMPTS]
            for arch in ("gemma4_moe", "qwen3_moe")}


def _run(model, draft=None, oracle=None, **kw):
    eng = InProcEngine(model, draft=draft, page_size=4, chunked_prefill_size=16, **kw)
    if oracle is not None:  # a draft that is often right: multi-token verify steps
        eng.runner.assistant = BigramDraft(eng.runner.target, bigram_table(oracle))
    eng.submit("r0", PROMPTS[0], max_new_tokens=NEW, ignore_eos=True)
    eng.run(until=lambda: len(eng.tokens["r0"]) >= 2)
    for i, p in enumerate(PROMPTS[1:], 1):
        eng.submit(f"r{i}", p, max_new_tokens=NEW, ignore_eos=True)
    eng.run()
    return [eng.tokens[f"r{i}"] for i in range(len(PROMPTS))], eng


@pytest.mark.parametrize("arch", ["gemma4_moe", "qwen3_moe"])
def test_moe_engine_matches_hf(ckpts, refs, arch):
    got, _ = _run(ckpts[arch])
    assert got == refs[arch]


@pytest.mark.parametrize("draft", ["assistant", "oracle"])
@pytest.mark.parametrize("overlap", [True, False])
def test_moe_target_with_mtp_is_lossless(ckpts, refs, overlap, draft):
    oracle = [p + r for p, r in zip(PROMPTS, refs["gemma4_moe"])] if draft == "oracle" else None
    got, eng = _run(ckpts["gemma4_moe"], draft=ckpts["assistant"], oracle=oracle, overlap=overlap)
    assert eng.runner.assistant is not None
    assert got == refs["gemma4_moe"]
    if oracle:
        assert sum(eng.core.counters.per_pos) > 5  # drafts were accepted: verify steps of several tokens


@pytest.mark.parametrize("arch,draft,overlap", [("qwen3_moe", None, True), ("gemma4_moe", "assistant", True),
                                               ("gemma4_moe", "oracle", False)])
def test_moe_kernels_in_the_engine_match_hf(ckpts, refs, arch, draft, overlap, monkeypatch):
    """The assistant's own draft, or the oracle's accepted drafts (verify rows of 4 tokens: the
    experts' decode path alone, the grouped path with other rows)."""
    monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    oracle = [p + r for p, r in zip(PROMPTS, refs[arch])] if draft == "oracle" else None
    got, eng = _run(ckpts[arch], draft=ckpts["assistant"] if draft else None, oracle=oracle, overlap=overlap,
                    attention_backend="triton", cuda_graph_bs=(1, 2, 4))
    assert eng.runner.graphs is not None
    assert got == refs[arch]
