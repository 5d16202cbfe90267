"""Structured output through the scheduler + worker (overlap depth 3), against a reference loop
that masks HF transformers' logits with xgrammar's own matcher and mask kernel, plain and MTP."""

from __future__ import annotations

import json
import os
import re

import pytest
import xgrammar as xgr  # a core dependency: if it is missing this file fails loudly

from proto.messages import GrammarSpec
from scheduler_proc.pages import page_hashes
from tests.helpers.checkpoints import hf_greedy, hf_model
from tests.helpers.inproc import InProcEngine
from tests.helpers.oracle_draft import BigramDraft, bigram_table
from tests.unit.gpu_worker.structured.grammar_cases import ENDS, PROMPTS, SCHEMA, SPECS, grammar_compiler, models, reference  # noqa: F401 - fixture


def _submit_all(eng, model_dir, n=24, prompts=3, model=None):
    model, compiler, refs = model or hf_model(model_dir), grammar_compiler(model_dir), {}
    for name, spec in SPECS.items():
        for i, p in enumerate(PROMPTS[:prompts]):
            rid = f"{name}{i}"
            eng.submit(rid, p, max_new_tokens=n, grammar=spec)
            refs[rid] = reference(model, compiler, spec, p, n)
    return refs


@pytest.mark.parametrize("mtp,graphs", [(False, False), (True, False), (True, True)])
def test_greedy_matches_the_masked_reference(models, mtp, graphs, monkeypatch):
    """``graphs``: the triton backend with CUDA graphs emulated (decode steps replay the bucket
    buffers, so constrained rows take the graph step's eager selection, not the greedy tail)."""
    llama, g, a = models
    target = g if mtp else llama
    kw = {}
    if graphs:
        monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
        kw = dict(attention_backend="triton", cuda_graph_bs=(1, 2, 4, 8, 16))
    eng = InProcEngine(target, draft=a if mtp else None, steps=3, page_size=4, **kw)
    refs = _submit_all(eng, target, n=16 if graphs else 24, prompts=2 if graphs else 3)  # (the interpreter is slow)
    if mtp:  # an oracle draft from the references: multi-token steps through the masks happen
        eng.runner.assistant = BigramDraft(eng.runner.target, bigram_table([PROMPTS[int(r[-1])] + t
                                                                            for r, t in refs.items()]))
        if graphs:  # capture again with the oracle draft inside
            eng.runner.enable_graphs(list(kw["cuda_graph_bs"]), emulate=True)
    eng.submit("plain", PROMPTS[1], max_new_tokens=12, ignore_eos=True)  # unconstrained, same batches
    eng.run()
    for rid, ref in refs.items():
        assert eng.tokens[rid] == ref, rid
        assert eng.finish[rid] == ("stop" if ref[-1] in ENDS else "length"), rid
    assert eng.tokens["plain"] == hf_greedy(target, PROMPTS[1], 12, ignore_eos=True)
    assert any(eng.finish[r] == "stop" for r in refs)  # some grammars complete within the budget
    if mtp:
        assert eng.core.counters.accepted > 0


def _text(model_dir, ids):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).decode(ids)


@pytest.mark.parametrize("mtp", [False, True])
def test_sampled_rows_stay_inside_the_grammar(models, mtp):
    llama, g, a = models
    target = g if mtp else llama
    eng = InProcEngine(target, draft=a if mtp else None, steps=3, page_size=4)
    choices = json.loads(SPECS["choice"].text)
    for i in range(6):
        eng.submit(f"c{i}", PROMPTS[i % 3], max_new_tokens=30, temperature=1.0, seed=i, grammar=SPECS["choice"])
        eng.submit(f"r{i}", PROMPTS[i % 3], max_new_tokens=30, temperature=1.3, top_p=0.9, seed=i,
                   grammar=SPECS["regex"])
    eng.run()
    for i in range(6):
        assert eng.finish[f"c{i}"] == "stop" and eng.tokens[f"c{i}"][-1] in ENDS
        assert _text(target, eng.tokens[f"c{i}"]) in choices
        text = _text(target, eng.tokens[f"r{i}"])
        if eng.finish[f"r{i}"] == "stop":
            assert re.fullmatch(SPECS["regex"].text, text), text
        else:  # cut by max_tokens: still a prefix the regex allows
            assert re.fullmatch(r"[0-9]{0,4}(-((ab|cd)+\.?|a|c)?)?", text), text


def test_a_grammar_that_does_not_compile_fails_its_request_alone(models):
    llama, _, _ = models
    eng = InProcEngine(llama, page_size=4)
    eng.submit("bad", PROMPTS[0], max_new_tokens=8, grammar=GrammarSpec("regex", "[a-"))
    eng.submit("badjson", PROMPTS[1], max_new_tokens=8, grammar=GrammarSpec("json", '{"type": "nonsense"}'))
    eng.submit("good", PROMPTS[2], max_new_tokens=8, grammar=SPECS["choice"])
    eng.run()
    for rid in ("bad", "badjson"):
        (out,) = eng.outputs[rid]
        assert out.finish_reason == "error" and out.error_code == 400 and eng.tokens[rid] == []
        assert out.error.startswith(f"invalid {'regex' if rid == 'bad' else 'json'} grammar: "), out.error
        assert "/project/" not in out.error  # xgrammar's source path is not the user's business
    assert _text(llama, eng.tokens["good"]) in json.loads(SPECS["choice"].text)


def test_after_the_grammar_ends_only_end_ids_follow(models):
    """min_tokens masks the end ids a complete grammar allows alone: the grammar wins (no NaN,
    no token outside it); with ignore_eos the row goes on with end ids up to max_tokens."""
    llama, _, _ = models
    eng = InProcEngine(llama, page_size=4)
    eng.submit("min", PROMPTS[0], max_new_tokens=20, min_new_tokens=9, grammar=SPECS["choice"])
    eng.submit("ign", PROMPTS[1], max_new_tokens=12, ignore_eos=True, grammar=SPECS["choice"])
    eng.run()
    choices = json.loads(SPECS["choice"].text)
    for rid, n in (("min", None), ("ign", 12)):
        toks = eng.tokens[rid]
        k = next(i for i, t in enumerate(toks) if t in ENDS)
        assert _text(llama, toks[:k]) in choices and all(t in ENDS for t in toks[k:]), toks
        assert n is None or len(toks) == n
    assert len(eng.tokens["min"]) >= 9 and eng.finish["min"] == "stop"


def test_a_preempted_request_resumes_its_grammar(models):
    """A re-prefill folds the outputs so far into the prompt: the new matcher replays them."""
    llama, _, _ = models
    eng = InProcEngine(llama, page_size=4, max_total_tokens=96, max_running_requests=8)
    model, compiler = hf_model(llama), grammar_compiler(llama)
    refs = {}
    for i in range(6):
        p = PROMPTS[i % 3] + [40 + i]
        eng.submit(f"j{i}", p, max_new_tokens=24, grammar=SPECS["json"])
        refs[f"j{i}"] = reference(model, compiler, SPECS["json"], p, 24)
    eng.run()
    assert eng.core.counters.preemptions > 0
    for rid, ref in refs.items():
        assert eng.tokens[rid] == ref, rid


def test_a_re_prefill_that_hits_its_own_outputs_in_the_cache_replays_them(models):
    """A preempted request publishes its output pages; its re-prefill would find them in the
    prefix cache and start past ``prompt_len``. Its matcher is fresh: it must still see every
    output token (else its state lags the text and the masks follow another grammar state)."""
    llama, _, _ = models
    eng = InProcEngine(llama, page_size=4)
    prompt = PROMPTS[0]
    ref = reference(hf_model(llama), grammar_compiler(llama), SPECS["json"], prompt, 28)
    eng.submit("j", prompt, max_new_tokens=28, grammar=SPECS["json"])
    req, on_result = eng.core.by_rid["j"], eng.core.on_result

    def preempt_once(res):  # as when pages run out: drain, release (publishing its pages), requeue
        on_result(res)
        if len(req.output_ids) >= 10 and not req.finished and eng.core.counters.preemptions == 0:
            eng.core.preempt(req)

    eng.core.on_result = preempt_once
    cached, admit = [], eng.planner._admit_one

    def admit_one(r, budget):  # how far the cache holds the re-prefill's fill: into its outputs?
        if r.fill_tokens is not None:
            hashes = page_hashes(r.fill, 4, len(r.fill) // 4)
            cached.append(4 * next((i for i, h in enumerate(hashes) if h not in eng.core.alloc._page_of), len(hashes)))
        return admit(r, budget)

    eng.planner._admit_one = admit_one
    eng.run()
    assert eng.core.counters.preemptions == 1 and cached[0] > len(prompt)
    assert eng.tokens["j"] == ref


def test_fixed_separators_when_any_whitespace_is_off(models):
    """``GrammarSpec.any_whitespace=False`` (vLLM's disable_any_whitespace): the reference
    compiled the same way gives the same tokens, and differs from the any-whitespace grammar."""
    llama, _, _ = models
    eng = InProcEngine(llama, page_size=4)
    spec = GrammarSpec("json", SPECS["json"].text, any_whitespace=False)
    eng.submit("fixed", PROMPTS[2], max_new_tokens=24, grammar=spec)
    eng.run()
    model, compiler = hf_model(llama), grammar_compiler(llama)
    ref = reference(model, compiler, spec, PROMPTS[2], 24)
    assert eng.tokens["fixed"] == ref
    assert ref != reference(model, compiler, SPECS["json"], PROMPTS[2], 24)


def test_without_xgrammar_a_constrained_request_fails_alone(models, monkeypatch):
    """An install without xgrammar (or a model without tokenizer.json): each constrained request
    is a 400 naming the cause, and the engine goes on serving the others."""
    import builtins

    real_import = builtins.__import__

    def no_xgrammar(name, *args, **kw):
        if name == "xgrammar":
            raise ModuleNotFoundError("No module named 'xgrammar'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    llama, _, _ = models
    eng = InProcEngine(llama, page_size=4)
    eng.submit("c", PROMPTS[0], max_new_tokens=8, grammar=SPECS["choice"])
    eng.submit("free", PROMPTS[1], max_new_tokens=6, ignore_eos=True)
    eng.run()
    (out,) = eng.outputs["c"]
    assert out.finish_reason == "error" and out.error_code == 400
    assert out.error == "structured output is unavailable: No module named 'xgrammar'"
    assert len(eng.tokens["free"]) == 6


STRUCTURAL = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "<f>"}, {"type": "json_schema", "json_schema": SCHEMA},
    {"type": "const_string", "value": "</f>"}]}}
LEGACY = {"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f"]}


def test_structural_tags_compile_and_bind(models):
    """Both forms of a structural tag: the format object gives the masked reference's tokens
    (xgrammar compiling the same tag); the older structures + triggers form compiles and its answer
    is one the tag's own matcher accepts; a format xgrammar does not know fails its request alone."""
    llama, _, _ = models
    eng = InProcEngine(llama, page_size=4)
    tag = GrammarSpec("structural_tag", json.dumps(STRUCTURAL))
    eng.submit("tag", PROMPTS[0], max_new_tokens=30, grammar=tag)
    eng.submit("legacy", PROMPTS[1], max_new_tokens=12, grammar=GrammarSpec("structural_tag", json.dumps(LEGACY)))
    eng.submit("bad", PROMPTS[2], max_new_tokens=4, grammar=GrammarSpec("structural_tag", json.dumps(
        {"type": "structural_tag", "format": {"type": "nonsense"}})))
    eng.run()
    compiler = grammar_compiler(llama)
    ref = reference(hf_model(llama), compiler, tag, PROMPTS[0], 30)
    assert eng.tokens["tag"] == ref and _text(llama, ref).startswith("<f>")
    items = [xgr.StructuralTagItem(begin="<f>", schema=json.dumps(SCHEMA), end="</f>")]
    legacy = xgr.GrammarMatcher(compiler.compile_structural_tag(items, ["<f"]))
    assert all(legacy.accept_token(t) for t in eng.tokens["legacy"] if t not in ENDS)
    (out,) = eng.outputs["bad"]
    assert out.finish_reason == "error" and out.error_code == 400
    assert out.error.startswith("invalid structural_tag grammar: ") and "nonsense" in out.error
    assert "Check failed" not in out.error and "/" not in out.error.split(": ", 1)[1]  # no C++ internals
