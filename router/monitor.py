"""Background loops: health checks, engine load polling, tree eviction.

Each loop wakes on its interval, checks every worker concurrently with bounded timeouts, and
never raises (an error is a failed check). A worker turning healthy also learns its served
models from ``/v1/models``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.workers import KV_GAUGES, RUNNING_GAUGES, WAITING_GAUGES, Worker, WorkerRegistry

log = logging.getLogger("tandem.router")


class Monitor:
    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, client: aiohttp.ClientSession,
                 metrics: RouterMetrics, evict=None):
        self.cfg = cfg
        self.registry = registry
        self.client = client
        self.metrics = metrics
        self._evict = evict
        self._tasks: list[asyncio.Task] = []
        self._wake_health = asyncio.Event()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(self.cfg.health_check_interval_s, self.check_all, self._wake_health)),
                       asyncio.create_task(self._loop(self.cfg.load_poll_interval_s, self.poll_all))]
        if self._evict is not None:
            self._tasks.append(asyncio.create_task(self._loop(self.cfg.cache.eviction_interval_s, self._evict_once)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def wake(self) -> None:
        """Run the health checks now (a worker just refused a connection)."""
        self._wake_health.set()

    async def _loop(self, interval: float, fn, wake: asyncio.Event | None = None) -> None:
        while True:
            try:
                if wake is None:
                    await asyncio.sleep(interval)
                else:
                    try:
                        await asyncio.wait_for(wake.wait(), interval)
                    except asyncio.TimeoutError:
                        pass
                    wake.clear()
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in a check must not stop the loop
                log.exception("monitor loop error")

    async def _evict_once(self) -> None:
        removed = self._evict()
        if removed:
            log.info("cache tree eviction removed %d characters", removed)

    # ------------------------------------------------------------------ health
    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.registry.all()))

    async def check(self, w: Worker) -> bool:
        cfg = self.cfg
        ok, reason = False, ""
        try:
            async with self.client.get(w.url + cfg.health_check_endpoint, timeout=self._timeout(cfg.health_check_timeout_s)) as r:
                ok = r.status == 200
                reason = "" if ok else f"{cfg.health_check_endpoint} returned {r.status}"
                await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if w.removed:
            return False
        self.metrics.health_checks.labels(w.url, "ok" if ok else "fail").inc()
        if w.set_health(ok, cfg.health_success_threshold, cfg.health_failure_threshold, reason):
            if w.healthy:
                log.info("worker %s is healthy: in rotation", w.url)
                await self._learn_models(w)
            else:
                log.warning("worker %s is unhealthy: out of rotation (%s)", w.url, reason)
        elif ok and not w.models:
            await self._learn_models(w)
        return ok

    async def _learn_models(self, w: Worker) -> None:
        try:
            async with self.client.get(w.url + "/v1/models", timeout=self._timeout(self.cfg.health_check_timeout_s)) as r:
                data = (await r.json(content_type=None)).get("data", []) if r.status == 200 else []
            models = tuple(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))
            if models:
                w.models = models
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            pass

    @staticmethod
    def _timeout(seconds: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=seconds)

    # ------------------------------------------------------------------ load
    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(w) for w in self.registry.all() if w.healthy))

    async def poll(self, w: Worker) -> None:
        timeout = max(0.2, min(self.cfg.health_check_timeout_s, 2 * self.cfg.load_poll_interval_s))
        try:
            if w.load_source != "metrics":
                async with self.client.get(w.url + "/load", timeout=self._timeout(timeout)) as r:
                    body = await r.json(content_type=None) if r.status == 200 else None
                if body is not None and self._apply_load(w, body):
                    return
            async with self.client.get(w.url + "/metrics", timeout=self._timeout(timeout)) as r:
                if r.status == 200:
                    self._apply_metrics(w, await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass  # stale load is kept; health checks decide about the worker

    @staticmethod
    def _apply_load(w: Worker, body) -> bool:
        if not isinstance(body, dict) or "num_running_reqs" not in body:
            return False
        w.running = int(body.get("num_running_reqs") or 0)
        w.waiting = int(body.get("num_waiting_reqs") or 0)
        w.kv_usage = float(body.get("kv_cache_usage_perc") or 0.0)
        w.load_at, w.load_source = time.monotonic(), "load"
        return True

    @staticmethod
    def _apply_metrics(w: Worker, text: str) -> None:
        values: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            if fam.name in RUNNING_GAUGES + WAITING_GAUGES + KV_GAUGES:
                values[fam.name] = sum(s.value for s in fam.samples)
        pick = lambda names: next((values[n] for n in names if n in values), None)  # noqa: E731
        running, waiting, kv = pick(RUNNING_GAUGES), pick(WAITING_GAUGES), pick(KV_GAUGES)
        if running is None and waiting is None:
            return
        w.running, w.waiting, w.kv_usage = int(running or 0), int(waiting or 0), float(kv or 0.0)
        w.load_at, w.load_source = time.monotonic(), "metrics"
