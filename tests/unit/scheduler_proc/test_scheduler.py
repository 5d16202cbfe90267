"""Scheduler tests against a simulated worker whose tokens depend on its paged KV contents."""

from __future__ import annotations

import random
import time

import pytest

from proto.arrays import pack_i32
from proto.messages import AbortReq, GenerateReq, SamplingParams
from tests.unit.scheduler_proc.driver import Driver, make, submit
from tests.unit.sim_worker import EOS, reference


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_outputs_match_reference(t, depth, mixed):
    core, planner, worker = make(t=t, mixed=mixed)
    drv = Driver(core, planner, worker, depth)
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(1, 64) for _ in range(rng.randrange(1, 40))] for i in range(20)}
    for rid, p in prompts.items():
        submit(core, rid, p, max_new=rng.randrange(1, 30))
    drv.run_until_idle()
    for rid, p in prompts.items():
        req_max = len(drv.tokens[rid])
        ref = reference(p, 10**6, eos=True)
        assert drv.tokens[rid] == ref[:req_max], rid
        assert drv.finish[rid] in ("stop", "length")
        if drv.finish[rid] == "stop":
            assert drv.tokens[rid][-1] == EOS
    core.alloc.check_all_free()
    assert sorted(core.free_slots + core.slots_to_free) == list(range(1, 9))


def test_prefix_cache_hits_and_stays_correct():
    core, planner, worker = make(t=1, cache=True)
    drv = Driver(core, planner, worker, 2)
    shared = list(range(1, 30))
    submit(core, "a", shared + [5], max_new=5, ignore_eos=True)
    drv.run_until_idle()
    submit(core, "b", shared + [9, 9], max_new=5, ignore_eos=True)
    drv.run_until_idle()
    assert core.counters.prefix_hits >= 24
    assert drv.tokens["b"] == reference(shared + [9, 9], 5, eos=False)
    # The whole committed sequence of "a" was published: a follow-up turn hits it too.
    follow = shared + [5] + drv.tokens["a"][:-1] + [7]
    hits = core.counters.prefix_hits
    submit(core, "c", follow, max_new=3, ignore_eos=True)
    drv.run_until_idle()
    assert core.counters.prefix_hits - hits >= 32
    assert drv.tokens["c"] == reference(follow, 3, eos=False)
    core.alloc.check_all_free()


@pytest.mark.parametrize("mixed", [True, False])
def test_preemption_recomputes_and_stays_correct(mixed):
    # 20 usable pages of 4 tokens: four long requests cannot all fit, so some are preempted.
    core, planner, worker = make(t=4, num_pages=21, ps=4, slots=4, chunk=32, mixed=mixed)
    drv = Driver(core, planner, worker, 2)
    prompts = {f"p{i}": list(range(1 + i, 20 + i)) for i in range(4)}
    for rid, p in prompts.items():
        submit(core, rid, p, max_new=30, ignore_eos=True)
    drv.run_until_idle()
    assert core.counters.preemptions > 0
    for rid, p in prompts.items():
        assert drv.tokens[rid] == reference(p, 30, eos=False), rid
    core.alloc.check_all_free()


def test_min_tokens_and_stop_ids():
    core, planner, worker = make(t=4)
    drv = Driver(core, planner, worker, 2)
    p = [3, 4, 5]
    full = reference(p, 200, eos=False)
    stop_tok = full[5]
    params = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_tok,))
    core.add_request(GenerateReq("s", pack_i32(p), params, time.time()))
    drv.run_until_idle()
    cut = full.index(stop_tok) + 1
    assert drv.tokens["s"] == full[:cut] and drv.finish["s"] == "stop"


def test_prompt_too_long_is_an_error():
    core, planner, worker = make(max_context=32)
    submit(core, "x", list(range(1, 40)))
    (out,) = core.take_outputs()
    assert out.finish_reason == "error" and out.error_code == 400 and "context" in out.error


@pytest.mark.parametrize("t,depth,mixed", [(1, 3, True), (4, 3, True), (1, 2, True), (4, 2, True), (4, 1, True),
                                           (4, 3, False), (1, 2, False)])
def test_stress_admit_abort_finish_every_step(t, depth, mixed):
    core, planner, worker = make(t=t, num_pages=48, ps=4, slots=6, chunk=24, mixed=mixed)
    drv = Driver(core, planner, worker, depth)
    rng = random.Random(t * 10 + depth)
    prompts, n = {}, 0
    for step in range(3000):
        for _ in range(rng.randrange(0, 3)):
            rid = f"q{n}"
            n += 1
            prompts[rid] = [rng.randrange(1, 64) for _ in range(rng.randrange(1, 50))]
            submit(core, rid, prompts[rid], max_new=rng.randrange(1, 40), ignore_eos=rng.random() < 0.5)
        live = [r for r in prompts if r not in drv.finish]
        if live and rng.random() < 0.3:
            core.abort(AbortReq(rng.choice(live)))
        drv.step()
    drv.run_until_idle()
    assert len(drv.finish) == len(prompts), "every request ends with exactly one finish"
    for rid, p in prompts.items():
        if drv.finish[rid] != "abort":
            assert drv.tokens[rid] == reference(p, len(drv.tokens[rid]), eos=False), rid
    core.alloc.check_all_free()
    assert sorted(core.free_slots + core.slots_to_free) == list(range(1, 7))
    assert not core.by_slot and not core.running and not core.waiting


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_one_slot_serves_a_queue(depth):
    """Regression: a slot released when nothing else runs must be reusable at once."""
    core, planner, worker = make(t=2, slots=1)
    drv = Driver(core, planner, worker, depth)
    for i in range(4):
        submit(core, f"s{i}", [3 + i, 4, 5], max_new=5, ignore_eos=True)
    drv.run_until_idle(limit=500)
    assert len(drv.finish) == 4
    core.alloc.check_all_free()


def test_out_of_vocab_ids_are_refused():
    core, planner, worker = make()
    core.cfg = core.cfg.__class__(**{**core.cfg.__dict__, "vocab_size": 64})
    submit(core, "x", [1, 2, 64])
    core.add_request(GenerateReq("y", pack_i32([1, 2]), SamplingParams(stop_token_ids=(99,)), time.time()))
    outs = {o.rid: o for o in core.take_outputs()}
    assert outs["x"].error_code == 400 and "[0, 64)" in outs["x"].error
    assert outs["y"].finish_reason == "error" and "stop_token_ids" in outs["y"].error
    assert not core.waiting


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_decode_phase_counters(depth):
    """Decode-only steps are counted apart from steps with a prefill chunk: their tokens and the
    context their rows attend over (what benchmarks compare with a step roofline)."""
    core, planner, worker = make(t=1, chunk=64)
    prompts = {"a": list(range(3, 13)), "b": list(range(20, 26))}
    for rid, p in prompts.items():
        submit(core, rid, p, max_new=5, ignore_eos=True)
    drv = Driver(core, planner, worker, depth)
    drv.run_until_idle()
    st = core.stats()
    assert all(len(drv.tokens[r]) == 5 for r in prompts)
    # One step prefills both prompts and emits each first token; the other 4 tokens of each come
    # from decode-only steps, one per step with both rows in every one.
    assert st.decode_steps == 4 and st.decode_tokens == 8
    # Step k (k = 1..4) feeds output k of each row, which attends over prompt + k tokens.
    assert st.decode_ctx_tokens == sum(10 + k + 6 + k for k in range(1, 5))
    assert st.decode_busy_s <= st.worker_busy_s


def _kinds(plan):
    """'p' for a prefill step, 'd' for a decode step, 'pd' for both."""
    return ("p" if plan.extend else "") + ("d" if len(plan.decode_slots) else "")


@pytest.mark.parametrize("mixed", [True, False])
def test_prefill_rides_in_decode_steps_only_when_mixed(mixed):
    """Mixed: a newcomer's chunks share the running request's steps. Apart (the CPU's compiled
    decode steps): prefill steps of their own, a decode step after each, while both have work."""
    core, planner, worker = make(t=1, chunk=8, mixed=mixed)
    drv = Driver(core, planner, worker, 1)
    submit(core, "a", [3, 1, 4], max_new=40, ignore_eos=True)
    drv.step()  # a's prefill
    drv.step()  # a decodes
    submit(core, "b", list(range(1, 25)), max_new=4, ignore_eos=True)  # three chunks of 8
    kinds = []
    for _ in range(6):
        plan = planner.plan()
        kinds.append(_kinds(plan))
        core.on_result(worker.run(plan))
    if mixed:
        assert kinds[:3] == ["pd", "pd", "pd"], kinds
    else:
        assert kinds == ["p", "d", "p", "d", "p", "d"], kinds
    drv.run_until_idle()
    assert drv.tokens["a"] == reference([3, 1, 4], 40, eos=False)
    assert drv.tokens["b"] == reference(list(range(1, 25)), 4, eos=False)


@pytest.mark.parametrize("mixed", [True, False])
def test_mixing_is_the_workers_word(mixed):
    """The worker says whether its decode steps would lose by carrying prefill rows."""
    from common.args import ServerArgs
    from proto.messages import WorkerReady
    from scheduler_proc.core import SchedConfig

    ready = WorkerReady(page_size=16, num_pages=64, max_slots=8, vocab_size=256, max_context=512, dtype="float32",
                        device="cpu", architecture="LlamaForCausalLM", tokens_per_step=1, mixed_prefill=mixed)
    assert SchedConfig.from_ready(ready, ServerArgs(model_path="m")).mixed_prefill is mixed
