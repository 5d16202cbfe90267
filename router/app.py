"""The router's HTTP surface: proxied generation routes on raw ASGI, the rest on FastAPI
(health, workers, metrics, models)."""

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

from common.args import ArgError
from common.auth import APIKeyMiddleware
from router.config import RouterConfig, normalize_url
from router.federate import engine_metrics
from router.metrics import RouterMetrics
from router.monitor import Monitor
from router.policies import CacheAware, make_policy
from router.answer import Answer
from router.proxy import Proxy, error_response
from router.workers import Worker, WorkerRegistry

log = logging.getLogger("tandem.router")

ROUTED = ("/v1/completions", "/v1/chat/completions", "/generate")
UNROUTED = ("/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize")  # any worker will do
ENGINE_GETS = ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/version")


class Router:
    """Everything one router process holds; ``app`` serves it."""

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.registry = WorkerRegistry(cfg.breaker)
        self.policy = make_policy(cfg.policy, cfg.cache)
        cache = self.policy if isinstance(self.policy, CacheAware) else None
        self.metrics = RouterMetrics(self.registry.all, cache.tree.size if cache else None,
                                     (lambda: dict(cache.decisions)) if cache else None, ROUTED + UNROUTED)
        self.client: aiohttp.ClientSession | None = None
        self.monitor: Monitor | None = None
        self.proxy: Proxy | None = None
        self.started_at = time.time()
        for url in cfg.worker_urls:
            self.registry.add(url)

    async def start(self) -> None:
        cfg = self.cfg
        # One pooled client for every upstream call. aiohttp, not httpx: on the 2-vCPU VM a bare
        # Starlette proxy used 1.45 ms of CPU per request with httpx, 0.60 ms with aiohttp.
        # Idle connections are dropped before uvicorn's 5 s keep-alive would close them under us.
        connector = aiohttp.TCPConnector(limit=cfg.max_connections, limit_per_host=0, keepalive_timeout=4.0,
                                         ttl_dns_cache=300)
        # total bounds the whole upstream exchange, a stream's last byte included: nothing hangs.
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        # With --api-key every call of ours to an engine carries the key (a forwarded request
        # carries the client's, already checked to be the same).
        auth = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        self.client = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                            trust_env=False, headers=auth)
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


class RouterApp:
    """The proxied POST routes go straight to ``Proxy.serve``; everything else (lifespan
    included) to FastAPI. On the 2-vCPU VM the framework layers (middleware stack, routing,
    Request, StreamingResponse's task group) cost about a third of the router's CPU per request."""

    def __init__(self, router: Router, fallback: FastAPI):
        self.router, self.fallback = router, fallback
        self.hot = {**{p: True for p in ROUTED}, **{p: False for p in UNROUTED}}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.router.proxy is not None:
            routed = self.hot.get(scope["path"])
            if routed is not None:
                if scope["method"] == "POST":
                    await self.router.proxy.serve(scope, receive, send, scope["path"], routed)
                else:
                    await Answer.error(405, f"{scope['method']} is not allowed here; use POST").send(send, b"")
                return
        await self.fallback(scope, receive, send)


def build_app(router: Router) -> RouterApp | APIKeyMiddleware:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="Tandem router", lifespan=lifespan)
    app.state.router = router

    async def from_any_worker(request: Request) -> Response:
        """Engine-level GETs (server info, version) answered by the least loaded healthy worker."""
        assert router.client is not None
        ws = sorted(router.registry.available(), key=lambda w: w.load())
        if not ws:
            return error_response(503, "no healthy worker", "")
        try:
            timeout = aiohttp.ClientTimeout(total=router.cfg.health_check_timeout_s)
            async with router.client.get(ws[0].url + request.url.path, timeout=timeout) as r:
                ctype = r.headers.get("content-type", "application/json")
                return Response(await r.read(), r.status, media_type=ctype)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return error_response(502, f"{ws[0].id}: {type(exc).__name__}", "")

    for path in ENGINE_GETS:
        app.add_api_route(path, from_any_worker, methods=["GET"], include_in_schema=False)

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
        body = router.metrics.render()
        if router.cfg.engine_metrics and router.client is not None:
            body += await engine_metrics(router.client, router.registry.all(), router.cfg.health_check_timeout_s)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

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
    _add_engine_routes(app, router)
    served = RouterApp(router, app)
    if router.cfg.api_key is None:
        return served
    # Behind `serve --dp-size N --api-key` the router is the public door, and it answers some
    # routes itself (/workers: point traffic, prompts included, at any URL; /flush_cache;
    # /v1/models). Outermost, so the raw hot path is guarded too: our client session carries
    # the key, so an unchecked request would be forwarded with *our* credentials. Probes and the
    # scrape stay open unless --metrics-require-key.
    return APIKeyMiddleware(served, api_key=router.cfg.api_key, protect_ops=router.cfg.metrics_require_key,
                            open_paths=frozenset({"/health", "/liveness", "/readiness", "/metrics"}))


def _add_engine_routes(app: FastAPI, router: Router) -> None:
    """Routes that fan out to every engine: their loads, and a cache flush."""

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
