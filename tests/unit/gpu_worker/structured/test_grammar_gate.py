"""Grammars compile before their request is admitted (``scheduler_proc/grammar_gate.py``): a
compile that takes long holds only its own request, never a step of the others; a grammar that
does not compile ends its request with a 400 before it takes a slot; an abort meanwhile ends it
and the late answer is ignored. Engine tests run the scheduler and the worker's runner in one
process (the messages still go through msgspec); the scheduler test answers by hand."""

from __future__ import annotations

import threading
import time

from gpu_worker.structured.grammar import GrammarRows
from proto.arrays import pack_i32
from proto.messages import AbortReq, GenerateReq, GrammarCompile, GrammarDone, GrammarSpec, SamplingParams, StepResult
from scheduler_proc.request import Phase
from tests.helpers.checkpoints import hf_greedy, hf_model
from tests.helpers.inproc import InProcEngine
from tests.unit.gpu_worker.structured.grammar_cases import PROMPTS, SPECS, grammar_compiler, models, reference  # noqa: F401 - fixture
from tests.unit.scheduler_proc.driver import make

BAD = GrammarSpec("ebnf", "root ::= nothing")


def _blocked_compile(monkeypatch, spec: GrammarSpec) -> threading.Event:
    """``spec``'s compile waits for the returned event (30 s at most: then it fails loudly)."""
    go, real = threading.Event(), GrammarRows._compile_grammar

    def compile_grammar(self, s):
        if s == spec:
            assert go.wait(30), "nothing set the event: the engine waited on the compile"
        return real(self, s)

    monkeypatch.setattr(GrammarRows, "_compile_grammar", compile_grammar)
    return go


def test_a_slow_compile_holds_its_request_not_the_others(models, monkeypatch):
    llama, _, _ = models
    go = _blocked_compile(monkeypatch, SPECS["json"])
    eng = InProcEngine(llama, page_size=4, chunked_prefill_size=8)
    eng.submit("bad", PROMPTS[0], max_new_tokens=4, grammar=BAD)
    eng.submit("j", PROMPTS[0], max_new_tokens=16, grammar=SPECS["json"])
    eng.submit("plain", PROMPTS[1], max_new_tokens=20, ignore_eos=True)
    eng.run(until=lambda: "plain" in eng.finish)  # all of it while j's compile is blocked
    assert eng.tokens["plain"] == hf_greedy(llama, PROMPTS[1], 20, ignore_eos=True)
    (err,) = eng.outputs["bad"]
    assert err.finish_reason == "error" and err.error_code == 400 and eng.tokens["bad"] == []
    held = eng.core.by_rid["j"]
    assert held.phase is Phase.WAITING and held.slot == 0 and eng.tokens["j"] == [] and len(eng.core.gate) == 1
    assert eng.core.stats().num_waiting == 1
    go.set()
    eng.run()
    assert eng.tokens["j"] == reference(hf_model(llama), grammar_compiler(llama), SPECS["json"], PROMPTS[0], 16)
    assert not eng.core.gate.held and not eng.runner.grammar.precompiling


def test_a_slow_compile_leaves_the_other_grammars_a_thread(models, monkeypatch):
    llama, _, _ = models
    go = _blocked_compile(monkeypatch, SPECS["json"])
    eng = InProcEngine(llama, page_size=4)
    eng.submit("j", PROMPTS[0], max_new_tokens=16, grammar=SPECS["json"])  # first, and blocked
    eng.submit("r", PROMPTS[2], max_new_tokens=8, grammar=SPECS["regex"])
    eng.run(until=lambda: "r" in eng.finish)
    model, compiler = hf_model(llama), grammar_compiler(llama)
    assert eng.tokens["r"] == reference(model, compiler, SPECS["regex"], PROMPTS[2], 8) and eng.tokens["j"] == []
    go.set()
    eng.run()
    assert eng.tokens["j"] == reference(model, compiler, SPECS["json"], PROMPTS[0], 16)


def test_an_abort_while_compiling_ends_the_request_and_the_late_answer_is_ignored(models, monkeypatch):
    llama, _, _ = models
    go = _blocked_compile(monkeypatch, SPECS["regex"])
    eng = InProcEngine(llama, page_size=4)
    eng.submit("r", PROMPTS[2], max_new_tokens=8, grammar=SPECS["regex"])
    eng.submit("plain", PROMPTS[1], max_new_tokens=6)
    eng.run(until=lambda: "plain" in eng.finish)
    eng.core.abort(AbortReq("r"))
    assert len(eng.core.gate) == 0 and eng.core.stats().num_waiting == 0  # no longer waiting for it
    go.set()
    eng.run()  # drains: the compile's answer comes back for a finished request
    assert eng.finish["r"] == "abort" and eng.tokens["r"] == [] and eng.core.idle()
    eng.submit("r", PROMPTS[2], max_new_tokens=8, grammar=SPECS["regex"])  # the rid again: compiled before
    eng.run()
    assert eng.tokens["r"] == reference(hf_model(llama), grammar_compiler(llama), SPECS["regex"], PROMPTS[2], 8)


def test_the_scheduler_admits_a_grammar_request_only_once_it_compiled():
    core, planner, _ = make()
    spec = GrammarSpec("regex", "a+")

    def add(rid):
        core.add_request(GenerateReq(rid, pack_i32([5, 6, 7]), SamplingParams(grammar=spec), time.time()))

    def answer(plan, *done):
        core.on_result(StepResult(plan.step_id, b"", b"", b"", compiled=list(done)))

    add("a")
    assert not core.idle() and not core.waiting and core.stats().num_waiting == 1
    first = planner.plan()  # no rows: the grammar handed over
    assert (first.extend, first.admit, first.compile) == ([], [], [GrammarCompile(1, spec)])
    assert planner.plan() is None  # its answer is on the way: no second question
    answer(first)
    ask = planner.plan()  # nothing in flight, still compiling: a plan that asks
    assert (ask.extend, ask.compile) == ([], [])
    answer(ask, GrammarDone(1))
    admit = planner.plan()
    assert [r.params.grammar for r in admit.admit] == [spec] and admit.extend
    add("b")
    nxt = planner.plan()  # a's decode row carries the next grammar along
    assert len(nxt.decode_slots) and nxt.compile == [GrammarCompile(2, spec)]
    answer(admit)
    answer(nxt, GrammarDone(2, "invalid regex grammar: x"))
    (out,) = [o for o in core.take_outputs() if o.rid == "b"]
    assert (out.finish_reason, out.error_code, out.error) == ("error", 400, "invalid regex grammar: x")
    assert core.by_rid.get("b") is None and len(core.gate) == 0
    assert core.stats().steps == 2  # the plans with rows only
