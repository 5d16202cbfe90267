"""A grammar that binds after a token (``GrammarSpec.after``: the reasoning end under
``--reasoning-parser``): unconstrained up to the first time the request emits that token, then
the grammar from its start. Reference: HF logits, unmasked until that token, then masked by
xgrammar's own matcher and CPU kernel; plain, MTP with an oracle draft whose chains cross the
token, emulated CUDA graphs, and a preempted request whose re-prefill replays the token."""

from __future__ import annotations

import msgspec
import pytest

from tests.helpers.checkpoints import VOCAB, hf_greedy, hf_model
from tests.helpers.inproc import InProcEngine
from tests.helpers.oracle_draft import BigramDraft, bigram_table
from tests.unit.gpu_worker.structured.grammar_cases import ENDS, PROMPTS, SPECS, grammar_compiler, models, reference  # noqa: F401 - fixture


def start_token(free: list[int], at: int) -> int:
    """A token the unconstrained answer ``free`` first emits at index ``at`` or later (else the
    last new one: random checkpoints repeat themselves)."""
    new = [(i, t) for i, t in enumerate(free) if t not in free[:i] and t not in ENDS]
    assert new, free
    later = [t for i, t in new if i >= at]
    return later[0] if later else new[-1][1]


def _submit(eng, model_dir, names=("json", "regex", "choice"), n=20, prompts=PROMPTS, model=None):
    """Constrained requests whose start token comes 2-4 tokens into the free answer, plus one
    whose start token never comes (it must equal HF greedy). ``model``: the reference's HF model,
    which also gives the free answers (on another device its greedy path may differ)."""
    model, compiler, refs, firsts = model or hf_model(model_dir), grammar_compiler(model_dir), {}, {}
    for i, p in enumerate(prompts):
        free = hf_greedy(model_dir, p, n, ignore_eos=True, model=model)
        for j, name in enumerate(names):
            after = start_token(free, 2 + (i + j) % 3)
            spec = msgspec.structs.replace(SPECS[name], after=after)
            rid = f"{name}{i}"
            eng.submit(rid, p, max_new_tokens=n, grammar=spec)
            refs[rid] = reference(model, compiler, spec, p, n)
            firsts[rid] = refs[rid].index(after) + 1
    free = hf_greedy(model_dir, prompts[0], n, model=model)
    never = msgspec.structs.replace(SPECS["json"], after=next(t for t in range(6, VOCAB) if t not in free))
    eng.submit("never", prompts[0], max_new_tokens=n, grammar=never)
    refs["never"] = reference(model, compiler, never, prompts[0], n)
    return refs, firsts


@pytest.mark.parametrize("mtp,graphs", [(False, False), (True, False), (True, True)])
def test_greedy_matches_the_reference_across_the_start_token(models, mtp, graphs, monkeypatch):
    llama, g, a = models
    target = g if mtp else llama
    kw = {}
    if graphs:
        monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
        kw = dict(attention_backend="triton", cuda_graph_bs=(1, 2, 4, 8))
    eng = InProcEngine(target, draft=a if mtp else None, steps=3, page_size=4, **kw)
    small = dict(names=("json", "regex"), n=14, prompts=PROMPTS[:2]) if graphs else {}  # (the interpreter)
    refs, firsts = _submit(eng, target, **small)
    if mtp:  # drafts from the references: chains that run through the start token get verified
        eng.runner.assistant = BigramDraft(eng.runner.target, bigram_table(
            [PROMPTS[0 if r == "never" else int(r[-1])] + t for r, t in refs.items()]))
        if graphs:
            eng.runner.enable_graphs(list(kw["cuda_graph_bs"]), emulate=True)
    eng.run()
    free = {}
    assert refs["never"] == hf_greedy(target, PROMPTS[0], len(refs["never"]))
    for rid, ref in refs.items():
        assert eng.tokens[rid] == ref, rid
        if rid != "never":  # the grammar changed the answer after the start token, not before
            p = PROMPTS[int(rid[-1])]
            free.setdefault(rid[-1], hf_greedy(target, p, len(ref), ignore_eos=True))
            assert ref[:firsts[rid]] == free[rid[-1]][:firsts[rid]]
    assert any(ref[firsts[r]:] != free[r[-1]][firsts[r]:len(ref)] for r, ref in refs.items() if r != "never")
    if mtp:
        assert eng.core.counters.accepted > 0


def test_a_preempted_request_replays_its_start_token(models):
    """The re-prefill after preemption replays the outputs: the start token among them binds the
    fresh matcher at the same place, and the tokens after it advance it."""
    llama, _, _ = models
    eng = InProcEngine(llama, page_size=4, max_total_tokens=96, max_running_requests=8)
    model, compiler, refs = hf_model(llama), grammar_compiler(llama), {}
    for i in range(6):
        p = PROMPTS[i % 3] + [40 + i]
        spec = msgspec.structs.replace(SPECS["json"], after=start_token(hf_greedy(llama, p, 24, ignore_eos=True), 3))
        eng.submit(f"j{i}", p, max_new_tokens=24, grammar=spec)
        refs[f"j{i}"] = reference(model, compiler, spec, p, 24)
    eng.run()
    assert eng.core.counters.preemptions > 0
    for rid, ref in refs.items():
        assert eng.tokens[rid] == ref, rid
