"""Routing policies and the circuit breaker, in process with fake workers and a fake clock."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from router.config import BreakerConfig, CacheAwareConfig
from router.policies import CacheAware, ConsistentHash, PowerOfTwo, RandomPolicy, RoundRobin, RouteInfo
from router.workers import Worker, WorkerRegistry


def workers(n: int) -> list[Worker]:
    reg = WorkerRegistry(BreakerConfig())
    out = []
    for i in range(n):
        w, _ = reg.add(f"http://127.0.0.1:{9000 + i}")
        w.healthy = True
        out.append(w)
    return out


def test_round_robin_cycles():
    ws = workers(3)
    p = RoundRobin()
    assert [p.select(ws, RouteInfo("x")).url for _ in range(6)] == [w.url for w in ws] * 2


def test_random_uses_every_worker():
    ws = workers(3)
    p = RandomPolicy(random.Random(0))
    assert len({p.select(ws, RouteInfo("x")).url for _ in range(60)}) == 3


def test_power_of_two_prefers_the_lighter():
    ws = workers(2)
    ws[0].inflight = 10
    ws[1].running, ws[1].waiting = 1, 2  # engine-reported load counts too
    p = PowerOfTwo(random.Random(0))
    assert all(p.select(ws, RouteInfo("x")) is ws[1] for _ in range(20))
    ws[1].waiting = 20
    assert p.select(ws, RouteInfo("x")) is ws[0]


def test_consistent_hash_is_sticky_and_moves_only_a_departed_workers_keys():
    ws = workers(4)
    p = ConsistentHash()
    keys = [f"session-{i}" for i in range(200)]
    first = {k: p.select(ws, RouteInfo("", k)) for k in keys}
    assert all(p.select(ws, RouteInfo("", k)) is first[k] for k in keys)
    assert len(set(first.values())) == 4
    survivors = ws[:3]
    moved = [k for k in keys if p.select(survivors, RouteInfo("", k)) is not first[k]]
    assert moved and all(first[k] is ws[3] for k in moved)
    # No key: the routed text is the key.
    assert p.select(ws, RouteInfo("same prompt")) is p.select(ws, RouteInfo("same prompt"))


def test_cache_aware_keeps_a_prefix_on_one_worker_and_spreads_new_ones():
    ws = workers(3)
    p = CacheAware(CacheAwareConfig())
    systems = [f"system prompt number {i} " * 10 for i in range(6)]
    homes = {}
    for s in systems:
        homes[s] = p.select(ws, RouteInfo(s + "first question"))
    assert len(set(homes.values())) == 3  # new prefixes go to the smallest tree
    for q in range(5):
        for s in systems:
            assert p.select(ws, RouteInfo(s + f"question {q}")) is homes[s]
    assert p.decisions["cache_hit"] == 30 and p.decisions["smallest_tree"] == 6


def test_cache_aware_threshold():
    ws = workers(2)
    p = CacheAware(CacheAwareConfig(cache_threshold=0.5))
    home = p.select(ws, RouteInfo("abcdefghij"))
    other = p.select(ws, RouteInfo("zzzzzzzzzz"))  # smallest tree: the other worker
    assert other is not home
    # 4 of 10 characters match home's text: below the threshold -> smallest tree (home has 10, other 10;
    # min() keeps list order, so make home the larger one first).
    p.select(ws, RouteInfo("abcdefghijklmnop"))
    assert p.select(ws, RouteInfo("abcdXXXXXX")) is other
    assert p.select(ws, RouteInfo("abcdefgXXX")) is home  # 7/10 > 0.5


def test_cache_aware_imbalance_override_uses_sglang_thresholds():
    ws = workers(2)
    p = CacheAware(CacheAwareConfig())
    home = p.select(ws, RouteInfo("shared system prompt " * 5 + "q0"))
    other = next(w for w in ws if w is not home)
    home.inflight = 64  # max - min = 64: not > 64 -> still affinity
    assert p.select(ws, RouteInfo("shared system prompt " * 5 + "q1")) is home
    home.inflight = 65  # > 64 and 65 > 1.5 * 0
    assert p.select(ws, RouteInfo("shared system prompt " * 5 + "q2")) is other
    other.inflight = 50  # 65 - 50 = 15: balanced again; both trees now hold the prefix, and
    assert p.select(ws, RouteInfo("shared system prompt " * 5 + "q3")) is other  # a tie goes to the lighter
    other.inflight = 70
    assert p.select(ws, RouteInfo("shared system prompt " * 5 + "q4")) is home
    assert p.decisions["imbalance"] == 1


def test_cache_aware_hot_engine_loses_affinity_before_it_queues():
    ws = workers(3)
    p = CacheAware(CacheAwareConfig(hot_waiting_threshold=4, hot_kv_usage=0.9))
    home = p.select(ws, RouteInfo("long shared prefix " * 8 + "a"))
    home.waiting = 5  # engine says it is queueing, though the router's own count is 0
    cool = p.select(ws, RouteInfo("long shared prefix " * 8 + "b"))
    assert cool is not home and p.decisions["hot_override"] == 1
    home.waiting, home.kv_usage = 0, 0.95
    assert p.select(ws, RouteInfo("long shared prefix " * 8 + "c")) is not home
    home.kv_usage = 0.2
    assert p.select(ws, RouteInfo("long shared prefix " * 8 + "d")) is home
    for w in ws:  # all hot: affinity stands
        w.waiting = 10
    assert p.select(ws, RouteInfo("long shared prefix " * 8 + "e")) is home


def test_cache_aware_forget_and_eviction_cap():
    ws = workers(2)
    p = CacheAware(CacheAwareConfig(max_tree_size=100))
    for i in range(50):
        p.select(ws, RouteInfo(f"{i:04d} " + "x" * 40))
    assert max(p.tree.size(w.url) for w in ws) <= 200  # hard cap between periodic evictions
    p.evict()
    assert all(p.tree.size(w.url) <= 100 for w in ws)
    p.forget(ws[0])
    assert p.tree.size(ws[0].url) == 0


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_breaker_closed_open_half_open_closed():
    clock = Clock()
    cb = CircuitBreaker(BreakerConfig(failure_threshold=3, success_threshold=2, timeout_s=30, window_s=60), clock)
    assert cb.state == CLOSED and cb.allow()
    cb.record_failure()
    cb.record_failure()
    assert cb.state == CLOSED
    cb.record_failure()
    assert cb.state == OPEN and not cb.allow() and cb.code == 1
    clock.t += 29.9
    assert not cb.allow()
    clock.t += 0.2
    assert cb.allow() and cb.state == HALF_OPEN and cb.code == 2
    cb.record_failure()  # one failure in half-open re-opens
    assert cb.state == OPEN and not cb.allow()
    clock.t += 31
    assert cb.allow()
    cb.record_success()
    assert cb.state == HALF_OPEN
    cb.record_success()
    assert cb.state == CLOSED and cb.code == 0 and cb.transitions == 5


def test_breaker_window_forgets_old_failures_and_success_resets():
    clock = Clock()
    cb = CircuitBreaker(BreakerConfig(failure_threshold=2, window_s=10), clock)
    cb.record_failure()
    clock.t += 11
    cb.record_failure()
    assert cb.state == CLOSED  # the first one aged out
    cb.record_success()
    cb.record_failure()
    assert cb.state == CLOSED
    cb.record_failure()
    assert cb.state == OPEN


def test_breaker_disabled_never_opens():
    cb = CircuitBreaker(BreakerConfig(enabled=False, failure_threshold=1))
    for _ in range(5):
        cb.record_failure()
    assert cb.allow() and cb.state == CLOSED


@pytest.mark.parametrize("ok_streak_needed", [1, 3])
def test_worker_health_admission_and_ejection(ok_streak_needed):
    w = workers(1)[0]
    w.healthy = False
    assert w.set_health(True, ok_streak_needed, 2)  # a new worker: first pass admits
    assert w.healthy
    assert not w.set_health(False, ok_streak_needed, 2) and w.healthy  # one failure is tolerated
    assert w.set_health(False, ok_streak_needed, 2) and not w.healthy
    for i in range(ok_streak_needed - 1):
        w.set_health(True, ok_streak_needed, 2)
        assert not w.healthy
    w.set_health(True, ok_streak_needed, 2)
    assert w.healthy
    assert w.eject("refused") and not w.healthy and w.last_error == "refused"


def test_registry_add_find_remove_and_models():
    reg = WorkerRegistry(BreakerConfig())
    a, created = reg.add("http://127.0.0.1:1")
    assert created and reg.add("http://127.0.0.1:1") == (a, False)
    b, _ = reg.add("http://127.0.0.1:2")
    a.healthy = b.healthy = True
    a.models, b.models = ("m1",), ("m1", "m2")
    assert reg.find(a.id) is a and reg.find(b.url) is b
    assert reg.models() == ["m1", "m2"] and reg.available("m2") == [b]
    reg.remove(a)
    assert a.removed and reg.available() == [b] and len(reg) == 1
    assert Counter(w.id for w in reg.all()) == {b.id: 1}
