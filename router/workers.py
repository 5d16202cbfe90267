"""The worker registry: each engine's URL, health, circuit breaker, load and served models.

A worker is *available* when it is healthy, not removed, and its breaker allows a request.
Health: a new worker is admitted by its first passing check; an ejected one needs
``health_success_threshold`` passes in a row. It is ejected after
``health_failure_threshold`` failed checks in a row, or at once when a connection to it is
refused (its port is closed: the engine is dead or restarting).
Load: the router's own in-flight count, and the engine's running / waiting / KV usage polled
from its ``/load`` (or, for engines without one, its Prometheus gauges on ``/metrics``).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

from router.breaker import CircuitBreaker
from router.config import BreakerConfig, CacheAwareConfig

log = logging.getLogger("tandem.router")

# Gauges read from /metrics when an engine has no usable /load (ours, vLLM's, SGLang's names).
RUNNING_GAUGES = ("tandem:num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs")
WAITING_GAUGES = ("tandem:num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_GAUGES = ("tandem:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "sglang:token_usage")


@dataclass(eq=False)
class Worker:
    url: str
    id: str
    breaker: CircuitBreaker
    healthy: bool = False
    ever_healthy: bool = False
    removed: bool = False
    inflight: int = 0  # requests this router has open on it
    running: int = 0  # engine-reported (polled)
    waiting: int = 0
    kv_usage: float = 0.0
    load_at: float = 0.0  # monotonic time of the last successful poll
    load_source: str = ""  # "load" or "metrics"
    models: tuple[str, ...] = ()
    ok_streak: int = 0
    fail_streak: int = 0
    last_error: str = ""
    added_at: float = field(default_factory=time.time)

    def load(self) -> int:
        """Queue depth as the router sees it: the larger of its own count and the engine's."""
        return max(self.inflight, self.running + self.waiting)

    def available(self) -> bool:
        return self.healthy and not self.removed and self.breaker.allow()

    def hot(self, cfg: CacheAwareConfig) -> bool:
        """The engine says it is queueing or nearly out of KV: its cache affinity should yield."""
        return self.waiting > cfg.hot_waiting_threshold or self.kv_usage >= cfg.hot_kv_usage

    def set_health(self, ok: bool, success_threshold: int, failure_threshold: int, reason: str = "") -> bool:
        """Apply one health-check result; returns True when ``healthy`` changed."""
        before = self.healthy
        if ok:
            self.ok_streak, self.fail_streak = self.ok_streak + 1, 0
            if not self.healthy and (not self.ever_healthy or self.ok_streak >= success_threshold):
                self.healthy = self.ever_healthy = True
                self.last_error = ""  # it describes a past outage (or start-up), not this worker now
        else:
            self.fail_streak, self.ok_streak = self.fail_streak + 1, 0
            self.last_error = reason
            if self.healthy and self.fail_streak >= failure_threshold:
                self.healthy = False
        return before != self.healthy

    def eject(self, reason: str) -> bool:
        """Connection refused: out of rotation now; re-admitted by the health checks."""
        self.last_error = reason
        self.ok_streak = 0
        changed = self.healthy
        self.healthy = False
        return changed

    def describe(self) -> dict:
        return {
            "id": self.id, "url": self.url, "model_id": self.models[0] if self.models else None,
            "models": list(self.models), "is_healthy": self.healthy, "circuit_state": self.breaker.state,
            "load": self.load(), "requests_active": self.inflight, "num_running_reqs": self.running,
            "num_waiting_reqs": self.waiting, "kv_cache_usage_perc": self.kv_usage,
            "load_source": self.load_source or None, "last_error": self.last_error or None,
            "worker_type": "regular",
        }


class WorkerRegistry:
    """Workers by URL, in insertion order. Removal flags the object (in-flight requests keep it)."""

    def __init__(self, breaker_cfg: BreakerConfig):
        self._breaker_cfg = breaker_cfg
        self._by_url: dict[str, Worker] = {}
        self._ids = itertools.count()

    def add(self, url: str) -> tuple[Worker, bool]:
        """(worker, created); adding a URL twice returns the existing worker."""
        existing = self._by_url.get(url)
        if existing is not None:
            return existing, False
        worker = Worker(url=url, id=f"worker-{next(self._ids)}", breaker=CircuitBreaker(self._breaker_cfg))
        self._by_url[url] = worker
        return worker, True

    def remove(self, worker: Worker) -> None:
        worker.removed = True
        worker.healthy = False
        self._by_url.pop(worker.url, None)

    def find(self, key: str) -> Worker | None:
        """By id or by URL."""
        if key in self._by_url:
            return self._by_url[key]
        return next((w for w in self._by_url.values() if w.id == key), None)

    def all(self) -> list[Worker]:
        return list(self._by_url.values())

    def available(self, model: str | None = None) -> list[Worker]:
        """Workers that may take a request now; with ``model``, only those that serve it (or
        whose models are not known yet)."""
        out = [w for w in self._by_url.values() if w.available()]
        if model is not None:
            out = [w for w in out if not w.models or model in w.models]
        return out

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for w in self._by_url.values():
            if w.healthy:
                seen.update(dict.fromkeys(w.models))
        return list(seen)

    def __len__(self) -> int:
        return len(self._by_url)
