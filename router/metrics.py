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
        fams = {
            "requests_active": GaugeMetricFamily(P + "worker_requests_active", "Requests this router has open on the worker", labels=["worker"]),
            "running": GaugeMetricFamily(P + "worker_num_requests_running", "Engine-reported running requests (polled)", labels=["worker"]),
            "waiting": GaugeMetricFamily(P + "worker_num_requests_waiting", "Engine-reported waiting requests (polled)", labels=["worker"]),
            "kv": GaugeMetricFamily(P + "worker_kv_cache_usage_perc", "Engine-reported KV usage, 0-1 (polled)", labels=["worker"]),
            "load": GaugeMetricFamily(P + "worker_load", "Load used for routing: max(router in-flight, engine running+waiting)", labels=["worker"]),
            "healthy": GaugeMetricFamily(P + "worker_healthy", "1 if the worker is in rotation", labels=["worker"]),
            "cb": GaugeMetricFamily(P + "worker_cb_state", "Circuit breaker: 0 closed, 1 open, 2 half-open", labels=["worker"]),
        }
        cb_trans = CounterMetricFamily(P + "worker_cb_transitions", "Circuit breaker state changes", labels=["worker"])
        tree = GaugeMetricFamily(P + "cache_tree_size_chars", "Characters in the worker's approximate prefix tree", labels=["worker"])
        for w in ws:
            lbl = [w.url]
            fams["requests_active"].add_metric(lbl, w.inflight)
            fams["running"].add_metric(lbl, w.running)
            fams["waiting"].add_metric(lbl, w.waiting)
            fams["kv"].add_metric(lbl, w.kv_usage)
            fams["load"].add_metric(lbl, w.load())
            fams["healthy"].add_metric(lbl, 1.0 if w.healthy else 0.0)
            fams["cb"].add_metric(lbl, w.breaker.code)
            cb_trans.add_metric(lbl, w.breaker.transitions)
            if self._tree_size is not None:
                tree.add_metric(lbl, self._tree_size(w.url))
        yield from fams.values()
        yield cb_trans
        pool = GaugeMetricFamily(P + "workers", "Workers by state", labels=["state"])
        pool.add_metric(["total"], len(ws))
        pool.add_metric(["healthy"], sum(1 for w in ws if w.healthy))
        yield pool
        if self._tree_size is not None:
            yield tree
        if self._decisions is not None:
            dec = CounterMetricFamily(P + "cache_aware_decisions", "Why cache_aware picked a worker", labels=["decision"])
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
                 decisions: Callable[[], dict[str, int]] | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = _Children(Counter(P + "requests", "Requests answered by the router", ["route", "status"], registry=r))
        self.worker_requests = _Children(Counter(P + "worker_requests", "Upstream attempts per worker and outcome",
                                       ["worker", "outcome"], registry=r))
        self.duration = _Children(Histogram(P + "request_duration_seconds", "Router arrival to last byte sent",
                                  ["route"], buckets=DURATION_BUCKETS, registry=r))
        self.ttft = _Children(Histogram(P + "ttft_seconds", "Router arrival to first upstream body byte",
                              ["route"], buckets=DURATION_BUCKETS, registry=r))
        self.retries = _Children(Counter(P + "retries", "Upstream attempts retried on another try", ["route"], registry=r))
        self.retries_exhausted = _Children(Counter(P + "retries_exhausted", "Requests that failed after every retry",
                                         ["route"], registry=r))
        self.errors = _Children(Counter(P + "request_errors", "Requests that ended in a router-made error",
                              ["route", "reason"], registry=r))
        self.stream_errors = _Children(Counter(P + "stream_errors", "Streams broken after the first byte (SSE error sent)",
                                     ["route"], registry=r))
        self.disconnects = _Children(Counter(P + "client_disconnects", "Client went away; upstream request aborted",
                                   ["route"], registry=r))
        self.health_checks = _Children(Counter(P + "worker_health_checks", "Health checks by result", ["worker", "result"],
                                     registry=r))
        r.register(_WorkerCollector(workers, tree_size, decisions))

    def render(self) -> bytes:
        return generate_latest(self.registry)
