"""Routing policies. Each picks one worker from a non-empty list of available workers.

``cache_aware`` follows SGLang's gateway: if the load is imbalanced (max - min load >
balance_abs_threshold AND max > balance_rel_threshold * min) take the least loaded worker;
else take the worker whose tree matches the most of the routed text if the match ratio is
above cache_threshold, else the worker with the smallest tree. Beyond SGLang, load is the
larger of the router's in-flight count and the engine's polled running + waiting, and an
engine that reports itself hot (queueing, or KV nearly full) gives its affinity to the least
loaded engine that is not hot. The chosen worker's tree then learns the text.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from router.config import CacheAwareConfig
from router.radix import RadixTree
from router.workers import Worker


@dataclass(frozen=True)
class RouteInfo:
    text: str  # routed text, already cut to the bounded prefix
    key: str | None = None  # session / routing key (consistent_hash)


class Policy(Protocol):
    name: str

    def select(self, workers: list[Worker], info: RouteInfo) -> Worker: ...

    def forget(self, worker: Worker) -> None: ...


def least_loaded(workers: list[Worker]) -> Worker:
    # Ties go to the first in list order, which callers keep stable (registration order).
    return min(workers, key=lambda w: w.load())


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, workers: list[Worker], info: RouteInfo) -> Worker:
        worker = workers[self._next % len(workers)]
        self._next += 1
        return worker

    def forget(self, worker: Worker) -> None:
        pass


class RandomPolicy:
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, workers: list[Worker], info: RouteInfo) -> Worker:
        return self._rng.choice(workers)

    def forget(self, worker: Worker) -> None:
        pass


class PowerOfTwo:
    """Sample two workers, take the lighter one."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, workers: list[Worker], info: RouteInfo) -> Worker:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(workers, 2)
        return a if a.load() <= b.load() else b

    def forget(self, worker: Worker) -> None:
        pass


def _score(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest(), "big")


class ConsistentHash:
    """Rendezvous (highest-random-weight) hashing on the routing key: a key stays on its worker
    while that worker is available, and only the keys of a departed worker move. Requests
    without a key hash their routed text instead."""

    name = "consistent_hash"

    def select(self, workers: list[Worker], info: RouteInfo) -> Worker:
        key = info.key if info.key is not None else info.text
        return max(workers, key=lambda w: _score(key, w.url))

    def forget(self, worker: Worker) -> None:
        pass


class CacheAware:
    name = "cache_aware"

    def __init__(self, cfg: CacheAwareConfig, tree: RadixTree | None = None) -> None:
        self.cfg = cfg
        self.tree = tree or RadixTree()
        self.decisions: Counter[str] = Counter()  # why each pick was made (exported as a metric)

    def select(self, workers: list[Worker], info: RouteInfo) -> Worker:
        worker, why = self._choose(workers, info.text)
        self.decisions[why] += 1
        if info.text:
            self.tree.insert(info.text, worker.url)
            if self.tree.size(worker.url) > 2 * self.cfg.max_tree_size:  # between periodic evictions
                self.tree.evict(self.cfg.max_tree_size)
        return worker

    def _choose(self, workers: list[Worker], text: str) -> tuple[Worker, str]:
        cfg = self.cfg
        if len(workers) == 1:
            return workers[0], "single"
        loads = [w.load() for w in workers]
        lo, hi = min(loads), max(loads)
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            return least_loaded(workers), "imbalance"
        best, ratio = self._best_match(workers, text)
        if best is not None and ratio > cfg.cache_threshold:
            pick, why = best, "cache_hit"
        else:
            pick, why = min(workers, key=lambda w: self.tree.size(w.url)), "smallest_tree"
        if pick.hot(cfg):
            cool = [w for w in workers if not w.hot(cfg)]
            if cool:
                return least_loaded(cool), "hot_override"
        return pick, why

    def _best_match(self, workers: list[Worker], text: str) -> tuple[Worker | None, float]:
        if not text:
            return None, 0.0
        matched = self.tree.match(text)
        best, best_len = None, 0
        for w in workers:  # ties: the less loaded one
            n = matched.get(w.url, 0)
            if n > best_len or (n == best_len and n > 0 and best is not None and w.load() < best.load()):
                best, best_len = w, n
        return best, best_len / len(text)

    def forget(self, worker: Worker) -> None:
        self.tree.remove_tenant(worker.url)

    def evict(self) -> int:
        return self.tree.evict(self.cfg.max_tree_size)


def make_policy(name: str, cache_cfg: CacheAwareConfig) -> Policy:
    if name == "cache_aware":
        return CacheAware(cache_cfg)
    if name == "power_of_two":
        return PowerOfTwo()
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomPolicy()
    if name == "consistent_hash":
        return ConsistentHash()
    raise ValueError(f"unknown policy {name!r}")
