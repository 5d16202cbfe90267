"""The router's Prometheus series, all under ``tandem_router_`` (SGLang gateway's smg_* set).

Per-request series are ordinary counters / histograms. Per-worker state (load, health,
circuit state, tree size) is read from the registry at scrape time by a custom collector, so
a removed worker's series disappear with it. No ``_created`` series (they confuse parsers).
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.workers import Worker

try:  # prometheus_client >= 0.16
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
except ImportError:  # pragma: no cover
    pass

P = "tandem_router_"
# 1 ms .. 240 s, as the SGLang gateway's duration buckets.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0,
                    45.0, 60.0, 90.0, 120.0, 180.0, 240.0)


class _WorkerCollector(Collector):
    def __init__(self, workers: Callable[[], list[Worker]], tree_size: Callable[[str], int] | None,
                 decisions: Callable[[], dict[str, int]] | None):
        self._workers = workers
        self._tree_size = tree_size
        self._decisions = decisions

    def collect(self) -> Iterable:
        ws = self._workers()

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(P + name, doc, labels=["worker"])

        per_worker = [
            (gauge("worker_requests_active", "Requests this router has open on the worker"), lambda w: w.inflight),
            (gauge("worker_num_requests_running", "Engine-reported running requests (polled)"), lambda w: w.running),
            (gauge("worker_num_requests_waiting", "Engine-reported waiting requests (polled)"), lambda w: w.waiting),
            (gauge("worker_kv_cache_usage_perc", "Engine-reported KV usage, 0-1 (polled)"), lambda w: w.kv_usage),
            (gauge("worker_load", "Routing load: max(router in-flight, engine running + waiting)"),
             lambda w: w.load()),
            (gauge("worker_healthy", "1 if the worker is in rotation"), lambda w: 1.0 if w.healthy else 0.0),
            (gauge("worker_cb_state", "Circuit breaker: 0 closed, 1 open, 2 half-open"), lambda w: w.breaker.code),
            (CounterMetricFamily(P + "worker_cb_transitions", "Circuit breaker state changes", labels=["worker"]),
             lambda w: w.breaker.transitions),
        ]
        if self._tree_size is not None:
            size = self._tree_size
            per_worker.append((gauge("cache_tree_size_chars", "Characters in the worker's approximate prefix tree"),
                               lambda w: size(w.url)))
        for fam, value in per_worker:
            for w in ws:
                fam.add_metric([w.url], value(w))
            yield fam
        pool = GaugeMetricFamily(P + "workers", "Workers by state", labels=["state"])
        pool.add_metric(["total"], len(ws))
        pool.add_metric(["healthy"], sum(1 for w in ws if w.healthy))
        yield pool
        if self._decisions is not None:
            dec = CounterMetricFamily(P + "cache_aware_decisions", "Why cache_aware picked a worker",
                                      labels=["decision"])
            for why, n in sorted(self._decisions().items()):
                dec.add_metric([why], n)
            yield dec


class _Children:
    """``metric.labels(...)`` with the children cached: it is called several times per request."""

    def __init__(self, metric):
        self._metric = metric
        self._children: dict[tuple[str, ...], object] = {}

    def labels(self, *values: str):
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class RouterMetrics:
    def __init__(self, workers: Callable[[], list[Worker]], tree_size: Callable[[str], int] | None = None,
                 decisions: Callable[[], dict[str, int]] | None = None, routes: tuple[str, ...] = ()):
        self.registry = CollectorRegistry()
        r = self.registry
        c = lambda name, doc, labels: _Children(Counter(P + name, doc, labels, registry=r))  # noqa: E731
        h = lambda name, doc: _Children(  # noqa: E731
            Histogram(P + name, doc, ["route"], buckets=DURATION_BUCKETS, registry=r))
        self.requests = c("requests", "Requests answered by the router", ["route", "status"])
        self.worker_requests = c("worker_requests", "Upstream attempts per worker and outcome", ["worker", "outcome"])
        self.duration = h("request_duration_seconds", "Router arrival to last byte sent")
        self.ttft = h("ttft_seconds", "Router arrival to first upstream body byte")
        self.retries = c("retries", "Upstream attempts retried on another try", ["route"])
        self.retries_exhausted = c("retries_exhausted", "Requests that failed after every retry", ["route"])
        self.errors = c("request_errors", "Requests that ended in a router-made error", ["route", "reason"])
        self.stream_errors = c("stream_errors", "Streams broken after the first byte (SSE error sent)", ["route"])
        self.disconnects = c("client_disconnects", "Client went away; upstream request aborted", ["route"])
        self.health_checks = c("worker_health_checks", "Health checks by result", ["worker", "result"])
        r.register(_WorkerCollector(workers, tree_size, decisions))
        # Per-route event counters read 0 from start-up, not absent until their first event:
        # rate() and alerts on them then work on a router that has never retried.
        for route in routes:
            for counter in (self.retries, self.retries_exhausted, self.stream_errors, self.disconnects):
                counter.labels(route)

    def render(self) -> bytes:
        return generate_latest(self.registry)
