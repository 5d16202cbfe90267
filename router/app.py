"""The router's HTTP surface (FastAPI): proxied generation routes, health, workers, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
import msgspec
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proto.args import ArgError
from router.config import RouterConfig, normalize_url
from router.metrics import RouterMetrics
from router.monitor import Monitor
from router.policies import CacheAware, make_policy
from router.proxy import Proxy, error_response
from router.workers import Worker, WorkerRegistry

log = logging.getLogger("tandem.router")

ROUTED = ("/v1/completions", "/v1/chat/completions", "/generate")
UNROUTED = ("/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize")  # any worker will do


class Router:
    """Everything one router process holds; ``app`` serves it."""

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.registry = WorkerRegistry(cfg.breaker)
        self.policy = make_policy(cfg.policy, cfg.cache)
        cache = self.policy if isinstance(self.policy, CacheAware) else None
        self.metrics = RouterMetrics(self.registry.all, cache.tree.size if cache else None,
                                     (lambda: dict(cache.decisions)) if cache else None)
        self.client: aiohttp.ClientSession | None = None
        self.monitor: Monitor | None = None
        self.proxy: Proxy | None = None
        self.started_at = time.time()
        for url in cfg.worker_urls:
            self.registry.add(url)

    async def start(self) -> None:
        cfg = self.cfg
        # One pooled client for every upstream call. aiohttp, not httpx: on a 2-vCPU box httpx
        # spent ~1.4 ms of CPU per proxied request, aiohttp ~0.4 ms (BENCHMARKS.md, router section).
        connector = aiohttp.TCPConnector(limit=cfg.max_connections, limit_per_host=0, keepalive_timeout=30.0,
                                         ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout_s, sock_read=cfg.request_timeout_s)
        self.client = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                            trust_env=False)
        evict = self.policy.evict if isinstance(self.policy, CacheAware) else None
        self.monitor = Monitor(cfg, self.registry, self.client, self.metrics, evict)
        self.proxy = Proxy(cfg, self.registry, self.policy, self.client, self.metrics,
                           on_refused=lambda w: self.monitor.wake())
        # First checks before serving, bounded: a worker that is still starting joins later.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.monitor.check_all(), cfg.health_check_timeout_s + 1.0)
        self.monitor.start()

    async def stop(self) -> None:
        if self.monitor is not None:
            await self.monitor.stop()
        if self.client is not None:
            await self.client.close()

    # ------------------------------------------------------------------ workers API
    async def add_worker(self, url: str) -> tuple[Worker, bool]:
        worker, created = self.registry.add(url)
        if created:
            log.info("worker %s added (%s)", worker.url, worker.id)
            assert self.monitor is not None
            await self.monitor.check(worker)  # admitted at once if it is already healthy
        return worker, created

    def remove_worker(self, worker: Worker) -> None:
        self.registry.remove(worker)
        self.policy.forget(worker)
        log.info("worker %s removed (%s); its %d in-flight request(s) finish there", worker.url, worker.id,
                 worker.inflight)

    def workers_body(self) -> dict:
        ws = self.registry.all()
        return {"workers": [w.describe() for w in ws], "total": len(ws),
                "healthy": sum(1 for w in ws if w.healthy), "policy": self.cfg.policy}


def _url_from(request: Request, body: bytes) -> str:
    url = request.query_params.get("url")
    if url is None and body:
        try:
            obj = msgspec.json.decode(body)
        except msgspec.DecodeError:
            raise ArgError("body: not valid JSON") from None
        url = obj.get("url") if isinstance(obj, dict) else None
    if not isinstance(url, str) or not url:
        raise ArgError("url: required (JSON body {\"url\": ...} or ?url=)")
    return normalize_url(url, "url")


def build_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="Tandem router", lifespan=lifespan)
    app.state.router = router

    def proxied(path: str, routed: bool) -> None:
        async def endpoint(request: Request) -> Response:
            assert router.proxy is not None
            return await router.proxy.handle(request, path, routed)

        endpoint.__name__ = "proxy" + path.replace("/", "_")
        # A plain Starlette route: the body is forwarded as bytes, so FastAPI's per-request
        # dependency solving would be pure cost on the hot path.
        app.router.routes.insert(0, Route(path, endpoint, methods=["POST"]))  # matched first

    for path in ROUTED:
        proxied(path, True)
    for path in UNROUTED:
        proxied(path, False)

    @app.get("/liveness")
    async def liveness() -> Response:
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        if any(w.healthy for w in router.registry.all()):
            return Response(status_code=200)
        return error_response(503, "no healthy worker", "")

    @app.get("/readiness")
    async def readiness() -> Response:
        body = router.workers_body()
        return JSONResponse(body, status_code=200 if body["healthy"] else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [{"id": m, "object": "model", "created": int(router.started_at), "owned_by": "tandem"}
                 for m in router.registry.models()]
        return {"object": "list", "data": cards}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/workers")
    async def list_workers() -> dict:
        return router.workers_body()

    @app.get("/workers/{worker_id}")
    async def get_worker(worker_id: str) -> Response:
        w = router.registry.find(worker_id)
        if w is None:
            return error_response(404, f"no worker {worker_id!r}", "", "worker_id")
        return JSONResponse(w.describe())

    async def add(request: Request) -> Response:
        try:
            url = _url_from(request, await request.body())
        except ArgError as exc:
            return error_response(400, str(exc), "", "url")
        worker, created = await router.add_worker(url)
        return JSONResponse(worker.describe(), status_code=201 if created else 200)

    async def remove(request: Request, key: str | None) -> Response:
        if key is None:
            try:
                key = _url_from(request, await request.body())
            except ArgError as exc:
                return error_response(400, str(exc), "", "url")
        w = router.registry.find(key)
        if w is None:
            return error_response(404, f"no worker {key!r}", "", "url")
        router.remove_worker(w)
        return JSONResponse(w.describe())

    @app.post("/workers")
    async def post_worker(request: Request) -> Response:
        return await add(request)

    @app.delete("/workers/{worker_id}")
    async def delete_worker(request: Request, worker_id: str) -> Response:
        return await remove(request, worker_id)

    @app.delete("/workers")
    async def delete_worker_by_url(request: Request) -> Response:
        return await remove(request, None)

    # SGLang's legacy spellings.
    app.add_api_route("/add_worker", add, methods=["POST"], include_in_schema=False)

    async def legacy_remove(request: Request) -> Response:
        return await remove(request, None)

    app.add_api_route("/remove_worker", legacy_remove, methods=["POST"], include_in_schema=False)
    app.add_api_route("/list_workers", list_workers, methods=["GET"], include_in_schema=False)

    @app.get("/get_loads")
    async def get_loads() -> dict:
        return {"workers": [{"worker": w.url, "load": w.load(), "num_running_reqs": w.running,
                             "num_waiting_reqs": w.waiting, "kv_cache_usage_perc": w.kv_usage}
                            for w in router.registry.all()]}

    @app.post("/flush_cache")
    async def flush_cache() -> dict:
        assert router.client is not None
        ws = [w for w in router.registry.all() if w.healthy]

        async def one(w: Worker) -> tuple[str, int | str]:
            try:
                async with router.client.post(w.url + "/flush_cache", timeout=aiohttp.ClientTimeout(total=10.0)) as r:
                    return w.url, r.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return w.url, type(exc).__name__

        return {"results": dict(await asyncio.gather(*(one(w) for w in ws)))}

    return app
