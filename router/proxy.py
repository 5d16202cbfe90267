"""Forward one request to a worker: pick, send, retry before the first byte, then pass through.

Life of a request (the promise: it ends with the engine's answer or an explicit error):
1. Read the body, the facts the policy needs, and the request id (propagated, returned).
2. Attempt: pick an available worker, send, wait for the status line. For a stream, also wait
   for the first body chunk; for a JSON answer, read it whole. Until then nothing has reached
   the client, so 408/429/5xx, a refused connection, a timeout or a broken read is retried
   (backoff with jitter, another worker when there is one) up to ``max_retries`` times.
3. A stream is then relayed chunk by chunk. If the upstream breaks after that, the client gets
   ``data: {"error": ...}`` and ``data: [DONE]`` — never a silent cut or a hang.
A client that disconnects at any point cancels the upstream request (the connection is closed,
the engine sees the disconnect and aborts it, freeing its KV).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass

import aiohttp
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from router.config import RouterConfig
from router.extract import RequestFacts, read_facts
from router.metrics import RouterMetrics
from router.policies import Policy, RouteInfo, least_loaded
from router.workers import Worker, WorkerRegistry

log = logging.getLogger("tandem.router")

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                          "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length"})
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 408: "RequestTimeoutError",
                502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    etype = _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": etype, "param": param, "code": status}}


def error_response(status: int, message: str, rid: str, param: str | None = None) -> JSONResponse:
    headers = {"x-request-id": rid}
    if status in (429, 503):
        headers["Retry-After"] = "1"
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def sse_error(status: int, message: str) -> bytes:
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\ndata: [DONE]\n\n"


class _Retry(Exception):
    """This attempt failed before anything reached the client."""

    def __init__(self, reason: str, status: int = 502, response: Response | None = None):
        super().__init__(reason)
        self.status = status
        self.response = response  # the upstream's own answer, returned if retries run out


@dataclass
class _Ctx:
    route: str
    path: str
    body: bytes
    headers: dict[str, str]
    rid: str
    facts: RequestFacts
    info: RouteInfo | None  # None: not routed by the policy (tokenize and similar)
    t0: float


class Proxy:
    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, policy: Policy, client: aiohttp.ClientSession,
                 metrics: RouterMetrics, on_refused=None):
        self.cfg = cfg
        self.registry = registry
        self.policy = policy
        self.client = client
        self.metrics = metrics
        self._on_refused = on_refused or (lambda w: None)
        self._rng = random.Random()

    # ------------------------------------------------------------------ entry
    async def handle(self, request: Request, route: str, routed: bool = True) -> Response:
        t0 = time.perf_counter()
        body = await request.body()
        rid = self._request_id(request)
        facts = read_facts(route, body, self.cfg.cache.max_prefix_chars)
        headers = _forward_headers(request, rid)
        key = next((headers[h] for h in self.cfg.routing_key_headers if h in headers), facts.user)
        ctx = _Ctx(route, request.scope["path"], body, headers, rid, facts,
                   RouteInfo(facts.text, key) if routed else None, t0)
        attempt = asyncio.ensure_future(self._with_retries(ctx))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({attempt, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if attempt not in done:  # the client left before the answer started
            attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)
            self.metrics.disconnects.labels(route).inc()
            return Response(status_code=499)
        response = attempt.result()
        response.headers["x-request-id"] = rid
        return response

    def _request_id(self, request: Request) -> str:
        wanted = self.cfg.request_id_headers
        for k, v in request.scope["headers"]:  # raw ASGI pairs: cheaper than request.headers
            if v and k.decode("latin-1") in wanted:
                return v.decode("latin-1")[:256]
        return uuid.uuid4().hex

    # ------------------------------------------------------------------ attempts
    async def _with_retries(self, ctx: _Ctx) -> Response:
        retry = self.cfg.retry
        tries = 1 + (retry.max_retries if retry.enabled else 0)
        failed: set[str] = set()
        last: _Retry | None = None
        for n in range(tries):
            if n:
                self.metrics.retries.labels(ctx.route).inc()
                await asyncio.sleep(self._backoff(n))
            worker = self._pick(ctx, failed)
            if worker is None:
                if ctx.facts.model is not None and self.registry.available() and not self.registry.available(ctx.facts.model):
                    return self._final(ctx, error_response(404, f"The model `{ctx.facts.model}` does not exist.",
                                                           ctx.rid, "model"), "model_not_found")
                last = _Retry("no healthy worker is available", 503)
                continue
            try:
                return await self._attempt(ctx, worker)
            except _Retry as exc:
                failed.add(worker.url)
                last = exc
                log.info("request %s: attempt %d on %s failed: %s", ctx.rid, n + 1, worker.url, exc)
        assert last is not None
        self.metrics.retries_exhausted.labels(ctx.route).inc()
        if last.response is not None:
            return self._final(ctx, last.response, "upstream_error")
        return self._final(ctx, error_response(last.status, f"request failed after {tries} attempt(s): {last}",
                                               ctx.rid), "retries_exhausted")

    def _final(self, ctx: _Ctx, response: Response, reason: str) -> Response:
        self.metrics.errors.labels(ctx.route, reason).inc()
        self.metrics.requests.labels(ctx.route, str(response.status_code)).inc()
        self.metrics.duration.labels(ctx.route).observe(time.perf_counter() - ctx.t0)
        return response

    def _backoff(self, n: int) -> float:
        r = self.cfg.retry
        base = min(r.max_backoff_ms, r.initial_backoff_ms * r.backoff_multiplier ** (n - 1))
        return base * self._rng.uniform(1 - r.jitter_factor, 1 + r.jitter_factor) / 1000.0

    def _pick(self, ctx: _Ctx, failed: set[str]) -> Worker | None:
        workers = self.registry.available(ctx.facts.model)
        fresh = [w for w in workers if w.url not in failed]
        workers = fresh or workers
        if not workers:
            return None
        if ctx.info is None:
            return least_loaded(workers)
        return self.policy.select(workers, ctx.info)

    async def _attempt(self, ctx: _Ctx, w: Worker) -> Response:
        w.inflight += 1
        handed_off = False
        resp: aiohttp.ClientResponse | None = None
        try:
            try:
                resp = await self.client.post(w.url + ctx.path, data=ctx.body, headers=ctx.headers)
            except aiohttp.ClientConnectorError as exc:
                self._upstream_failed(w, "connect_error")
                if w.eject(f"connection refused: {exc}"):
                    log.warning("worker %s refused a connection: out of rotation", w.url)
                self._on_refused(w)
                raise _Retry(f"cannot connect to {w.url}") from None
            except asyncio.TimeoutError:
                self._upstream_failed(w, "timeout")
                raise _Retry(f"{w.url} timed out", 504) from None
            except aiohttp.ClientError as exc:
                self._upstream_failed(w, "transport_error")
                raise _Retry(f"{w.url}: {type(exc).__name__}") from None
            status = resp.status
            if status in RETRYABLE_STATUS:
                data = await self._read_quietly(resp)
                self._upstream_failed(w, f"status_{status}")
                raise _Retry(f"{w.url} answered {status}", status,
                             Response(data, status, self._response_headers(resp, w)))
            w.breaker.record_success()
            self.metrics.worker_requests.labels(w.url, "ok").inc()
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                out = await self._stream(ctx, w, resp)
            else:
                out = await self._whole(ctx, w, resp)
            handed_off = True
            return out
        finally:
            if not handed_off:
                w.inflight -= 1
                if resp is not None:
                    resp.close()  # drop the connection: an engine mid-request sees the disconnect

    async def _whole(self, ctx: _Ctx, w: Worker, resp: aiohttp.ClientResponse) -> Response:
        try:
            data = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._upstream_failed(w, "read_error")
            raise _Retry(f"{w.url}: broken answer ({type(exc).__name__})") from None
        resp.release()
        w.inflight -= 1
        elapsed = time.perf_counter() - ctx.t0
        self.metrics.ttft.labels(ctx.route).observe(elapsed)
        self.metrics.duration.labels(ctx.route).observe(elapsed)
        self.metrics.requests.labels(ctx.route, str(resp.status)).inc()
        return Response(data, resp.status, self._response_headers(resp, w))

    async def _stream(self, ctx: _Ctx, w: Worker, resp: aiohttp.ClientResponse) -> Response:
        chunks = resp.content.iter_any()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._upstream_failed(w, "read_error")
            raise _Retry(f"{w.url}: stream broke before its first byte ({type(exc).__name__})") from None
        self.metrics.ttft.labels(ctx.route).observe(time.perf_counter() - ctx.t0)
        relay = _Relay(self, ctx, w, resp)
        return _RelayResponse(relay, relay.body(first, chunks), resp.status, self._response_headers(resp, w))

    # ------------------------------------------------------------------ helpers
    def _upstream_failed(self, w: Worker, outcome: str) -> None:
        w.breaker.record_failure()
        self.metrics.worker_requests.labels(w.url, outcome).inc()

    @staticmethod
    async def _read_quietly(resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await asyncio.wait_for(resp.read(), 5.0)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return b""

    @staticmethod
    def _response_headers(resp: aiohttp.ClientResponse, w: Worker) -> dict[str, str]:
        out = {k.lower(): v for k, v in resp.headers.items()}
        out = {k: v for k, v in out.items() if k not in _HOP_HEADERS and k not in ("date", "server")}
        out["x-tandem-worker"] = w.id
        return out


class _Relay:
    """One upstream stream being relayed; ``finish`` runs exactly once however it ends."""

    def __init__(self, proxy: Proxy, ctx: _Ctx, w: Worker, resp: aiohttp.ClientResponse):
        self.proxy, self.ctx, self.w, self.resp = proxy, ctx, w, resp
        self.status = resp.status
        self.complete = False
        self._done = False

    async def body(self, first: bytes, chunks):
        p, ctx, w = self.proxy, self.ctx, self.w
        tail = b"\n\n"
        try:
            if first:
                tail = first[-2:]
                yield first
            async for chunk in chunks:
                tail = chunk[-2:] if len(chunk) >= 2 else tail[-1:] + chunk
                yield chunk
            self.complete = True
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # After the first byte there is no retry: tell the client explicitly.
            p._upstream_failed(w, "stream_broken")
            p.metrics.stream_errors.labels(ctx.route).inc()
            log.warning("request %s: stream from %s broke mid-way: %s", ctx.rid, w.url, type(exc).__name__)
            self.status = 502
            if tail != b"\n\n":  # the engine died inside an event: close it so ours parses
                yield b"\n\n"
            yield sse_error(502, f"upstream engine {w.id} failed mid-stream ({type(exc).__name__}); "
                                 "the output is incomplete")
        finally:
            await self.finish()

    async def finish(self, disconnected: bool = False) -> None:
        if self._done:
            return
        self._done = True
        p, ctx = self.proxy, self.ctx
        self.w.inflight -= 1
        if disconnected and self.status < 400:
            self.status = 499
            p.metrics.disconnects.labels(ctx.route).inc()
        if self.complete:
            self.resp.release()  # read to the end: the connection goes back to the pool
        else:
            self.resp.close()  # closing mid-stream drops the connection: the engine aborts
        p.metrics.requests.labels(ctx.route, str(self.status)).inc()
        p.metrics.duration.labels(ctx.route).observe(time.perf_counter() - ctx.t0)


class _RelayResponse(StreamingResponse):
    """A StreamingResponse that releases its upstream even if it is cancelled before the body
    generator ever ran (a client gone right after the headers)."""

    def __init__(self, relay: _Relay, content, status_code: int, headers: dict[str, str]):
        super().__init__(content, status_code, headers)
        self._relay = relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self._relay.finish(disconnected=True))


def _forward_headers(request: Request, rid: str) -> dict[str, str]:
    """The client's headers minus hop-by-hop ones, with the request id set."""
    out = {}
    for k, v in request.scope["headers"]:
        name = k.decode("latin-1")
        if name not in _HOP_HEADERS:
            out[name] = v.decode("latin-1")
    out["x-request-id"] = rid
    return out


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
