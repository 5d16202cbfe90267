"""Penalties and min_tokens through the scheduler + worker, against a reference greedy loop on
HF transformers logits (vLLM semantics), with and without MTP (drafts counted in-step)."""

from __future__ import annotations

import os

import pytest

from tests.helpers import hf_ref
from tests.helpers.checkpoints import build_assistant, build_gemma4, hf_greedy
from tests.helpers.inproc import InProcEngine
from tests.helpers.oracle_draft import BigramDraft, bigram_table


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pen")
    g = build_gemma4(os.path.join(root, "g"))
    return g, build_assistant(os.path.join(root, "a"), g)


CASES = [
    dict(repetition_penalty=1.3),
    dict(frequency_penalty=0.7),
    dict(presence_penalty=1.1),
    dict(repetition_penalty=0.8, frequency_penalty=0.3, presence_penalty=0.2),
]
PROMPTS = [[(9 * i + 4 * j) % 370 + 6 for j in range(4 + 9 * i)] for i in range(4)]


@pytest.mark.parametrize("mtp", [False, True])
def test_penalties_match_reference(pair, mtp):
    g, a = pair
    eng = InProcEngine(g, draft=a if mtp else None, steps=3, page_size=4)
    refs = {}
    for ci, case in enumerate(CASES):
        for pi, p in enumerate(PROMPTS):
            rid = f"c{ci}p{pi}"
            eng.submit(rid, p, max_new_tokens=20, ignore_eos=True, **case)
            refs[rid] = hf_ref.greedy(g, p, 20, repetition=case.get("repetition_penalty", 1.0),
                                      frequency=case.get("frequency_penalty", 0.0),
                                      presence=case.get("presence_penalty", 0.0), ignore_eos=True)
    if mtp:  # an oracle draft built from the penalised references: multi-token steps happen
        eng.runner.assistant = BigramDraft(eng.runner.target, bigram_table([p + refs[f"c{ci}p{pi}"]
                                                                            for ci in range(len(CASES))
                                                                            for pi, p in enumerate(PROMPTS)]))
    eng.submit("plain", PROMPTS[1], max_new_tokens=20, ignore_eos=True)  # shares batches, unpenalised
    eng.run()
    for rid, ref in refs.items():
        assert eng.tokens[rid] == ref, rid
    assert eng.tokens["plain"] == hf_greedy(g, PROMPTS[1], 20, ignore_eos=True)
    if mtp:
        assert eng.core.counters.accepted > 0


def test_min_tokens_masks_stop_tokens(pair):
    g, _ = pair
    p = PROMPTS[2]
    free = hf_greedy(g, p, 30, ignore_eos=True)
    stop = free[1]  # greedy would stop at its first occurrence, early
    eng = InProcEngine(g, page_size=4)
    eng.submit("m", p, max_new_tokens=30, min_new_tokens=6, stop_token_ids=(stop,), ignore_eos=True)
    eng.submit("n", p, max_new_tokens=30, stop_token_ids=(stop,), ignore_eos=True)
    eng.run()
    assert eng.tokens["n"] == free[: free.index(stop) + 1] and eng.finish["n"] == "stop"
    ref = hf_ref.greedy(g, p, 30, min_tokens=6, stop_ids=(stop,), ignore_eos=True)
    assert eng.tokens["m"] == ref
    assert stop not in eng.tokens["m"][:6]


@pytest.mark.parametrize("mtp", [False, True])
def test_logit_bias_matches_reference(pair, mtp):
    """OpenAI's logit_bias: added before penalties, greedy rows take the biased argmax (MTP's
    verify included), rows without a bias in the same batches are untouched, and a slot freed
    by a biased request serves an unbiased one cleanly (max_running_requests 2)."""
    g, a = pair
    first = [hf_greedy(g, p, 1, ignore_eos=True)[0] for p in PROMPTS]
    cases = {  # rid -> (prompt index, bias, extra params)
        "ban": (0, {first[0]: -100.0}, {}),
        "boost": (1, {7: 30.0, 11: 29.5}, {}),
        "wide": (2, {t: 0.5 * (t % 7) - 1.0 for t in range(20, 60)} | {first[2]: -100.0}, {}),  # widens the table
        "pen": (3, {first[3]: 4.0}, {"repetition_penalty": 1.3}),
    }
    eng = InProcEngine(g, draft=a if mtp else None, steps=3, page_size=4, max_running_requests=2)
    refs = {}
    for rid, (pi, bias, extra) in cases.items():
        ids = tuple(sorted(bias))
        eng.submit(rid, PROMPTS[pi], max_new_tokens=12, ignore_eos=True, logit_bias_ids=ids,
                   logit_bias=tuple(bias[i] for i in ids), **extra)
        refs[rid] = hf_ref.greedy(g, PROMPTS[pi], 12, repetition=extra.get("repetition_penalty", 1.0),
                                  ignore_eos=True, logit_bias=bias)
    if mtp:
        eng.runner.assistant = BigramDraft(eng.runner.target, bigram_table(
            [PROMPTS[pi] + refs[rid] for rid, (pi, _, _) in cases.items()]))
    for pi in range(2):  # unbiased, after the biased ones (reusing their slots)
        eng.submit(f"plain{pi}", PROMPTS[pi], max_new_tokens=12, ignore_eos=True)
    eng.run()
    for rid, ref in refs.items():
        assert eng.tokens[rid] == ref, rid
    assert refs["ban"][0] != first[0] and refs["boost"][0] == 7
    for pi in range(2):
        assert eng.tokens[f"plain{pi}"] == hf_greedy(g, PROMPTS[pi], 12, ignore_eos=True)
    if mtp:
        assert eng.core.counters.accepted > 0
