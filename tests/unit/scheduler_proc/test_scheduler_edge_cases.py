"""Scheduler edge cases, each pinned by a test (simulated worker, fast)."""

from __future__ import annotations

import time

from proto.arrays import pack_i32, view_i32
from proto.messages import AbortReq, GenerateReq, SamplingParams
from tests.unit.sim_worker import reference
from tests.unit.scheduler_proc.driver import Driver, make, submit


def test_no_decode_row_after_the_only_token_is_already_in_flight():
    """max_new_tokens=1: the sampled last prefill chunk yields the only token. With overlap the
    planner used to add a decode row (T tokens of verify, page growth, possibly a preemption of
    another request) whose tokens were always dropped: ``surely_done`` ignored the in-flight
    sampled chunk."""
    core, planner, worker = make(t=4)
    submit(core, "one", [3, 4, 5, 6, 7], max_new=1, ignore_eos=True)
    first = planner.plan()
    assert first is not None and first.extend and first.extend[0].sample
    assert planner.plan() is None  # nothing useful to run until the result is back
    drv = Driver(core, planner, worker, 2)
    drv.pending.append(worker.run(first))
    drv.run_until_idle()
    assert drv.tokens["one"] == reference([3, 4, 5, 6, 7], 1, eos=False) and drv.finish["one"] == "length"
    core.alloc.check_all_free()


def test_cached_tokens_never_exceed_the_prompt_after_a_preemption():
    """Usage's cached_tokens is a count of *prompt* tokens. A preempted request's re-prefill
    (prompt + its own outputs) usually hits the pages it published itself; that hit used to
    overwrite cached_tokens, so a 19-token prompt reported 40+ cached tokens."""
    core, planner, worker = make(t=4, num_pages=21, ps=4, slots=4, chunk=32)
    drv = Driver(core, planner, worker, 2)
    prompts = {f"p{i}": list(range(1 + i, 20 + i)) for i in range(4)}
    for rid, p in prompts.items():
        submit(core, rid, p, max_new=30, ignore_eos=True)
    outs = {}
    while not core.idle():
        while len(core.inflight) < 2 and (plan := planner.plan()) is not None:
            drv.pending.append(worker.run(plan))
        core.on_result(drv.pending.popleft())
        for o in core.take_outputs():
            outs.setdefault(o.rid, []).append(o)
    assert core.counters.preemptions > 0
    for rid, p in prompts.items():
        toks = [t for o in outs[rid] for t in view_i32(o.token_ids).tolist()]
        assert toks == reference(p, 30, eos=False), rid
        for o in outs[rid]:
            assert o.cached_tokens <= o.prompt_tokens == len(p), (rid, o.cached_tokens)


def test_abort_while_waiting_after_preemption_frees_everything():
    core, planner, worker = make(t=4, num_pages=21, ps=4, slots=4, chunk=32)
    drv = Driver(core, planner, worker, 2)
    for i in range(4):
        submit(core, f"p{i}", list(range(1 + i, 20 + i)), max_new=30, ignore_eos=True)
    aborted = None
    for _ in range(2000):
        drv.step()
        requeued = [r for r in core.waiting if r.output_ids]
        if requeued:
            aborted = requeued[0].rid
            core.abort(AbortReq(aborted))
            break
    assert aborted is not None, "no request was preempted"
    drv.run_until_idle()
    assert drv.finish[aborted] == "abort" and len(drv.finish) == 4
    core.alloc.check_all_free()
    assert not core.by_rid and not core.running and not core.waiting


def test_prefix_hit_then_flush_while_in_use_stays_exact():
    core, planner, worker = make(t=4, ps=4)
    drv = Driver(core, planner, worker, 2)
    shared = list(range(1, 26))
    submit(core, "a", shared + [7], max_new=12, ignore_eos=True)
    drv.run_until_idle()
    submit(core, "b", shared + [9], max_new=12, ignore_eos=True)
    submit(core, "c", shared + [9, 9], max_new=12, ignore_eos=True)
    drv.step()
    core.alloc.flush()  # pages in use lose their hash; their data stays valid for b and c
    drv.step()
    core.alloc.flush()
    drv.run_until_idle()
    assert drv.tokens["b"] == reference(shared + [9], 12, eos=False)
    assert drv.tokens["c"] == reference(shared + [9, 9], 12, eos=False)
    core.alloc.check_all_free()


def test_prompt_at_context_edge_with_mtp_and_overlap():
    """prompt_len = max_context - 1: exactly one token, no page beyond what the worker has."""
    core, planner, worker = make(t=4, ps=4, max_context=32)
    drv = Driver(core, planner, worker, 2)
    p = list(range(1, 32))
    core.add_request(GenerateReq("edge", pack_i32(p), SamplingParams(max_new_tokens=50, temperature=0.0,
                                                                      ignore_eos=True), time.time()))
    drv.run_until_idle()
    assert drv.tokens["edge"] == reference(p, 1, eos=False) and drv.finish["edge"] == "length"
    core.alloc.check_all_free()


def test_rid_is_reusable_as_soon_as_its_request_has_finished():
    """The front frees a rid when the finishing output arrives (and /generate takes rids from
    users). The scheduler kept a finished request in ``by_rid`` until its in-flight step
    drained, so reusing the rid at once was refused as a "duplicate request id" (400), and the
    late release would then have dropped the new request's entry."""
    core, planner, worker = make(t=1)
    drv = Driver(core, planner, worker, 2)
    p = [3, 4, 5]
    stop = reference(p, 20, eos=False)[2]
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))
    core.add_request(GenerateReq("x", pack_i32(p), params, time.time()))
    while "x" not in drv.finish:
        drv.step()
    assert core.inflight, "the finished request still has a step in flight"
    drv.finish.clear()
    drv.tokens.clear()
    core.add_request(GenerateReq("x", pack_i32(p), params, time.time()))
    drv.run_until_idle()
    assert drv.finish["x"] == "stop" and drv.tokens["x"] == reference(p, 20, eos=False)[:3]
    core.alloc.check_all_free()
    assert not core.by_rid


def test_random_seed_fixes_the_seeds_of_unseeded_requests():
    """--random-seed seeds the draw of unseeded requests' seeds: two schedulers started with the
    same value give the same requests, in the same order, the same seeds (each row then samples
    from its own stream, so batching cannot change them); a request's own seed always wins, and
    without a value the draws differ between starts."""
    from dataclasses import replace

    from scheduler_proc.core import SchedulerCore

    def seeds(random_seed):
        core, _, _ = make()
        core = SchedulerCore(replace(core.cfg, random_seed=random_seed))
        for i, own in enumerate((None, None, 12345, None)):
            core.add_request(GenerateReq(f"r{i}", pack_i32([1, 2, 3]), SamplingParams(seed=own), time.time()))
        return [core.by_rid[f"r{i}"].seed for i in range(4)]

    a, b, c = seeds(7), seeds(7), seeds(8)
    assert a == b and a[2] == c[2] == 12345
    assert len(set(a)) == 4 and a != c
    assert seeds(None)[0] != seeds(None)[0]
