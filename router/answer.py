"""What the proxy sends back, written straight to the ASGI ``send`` (no framework on the hot path).

``Answer`` is a whole response (JSON from the engine, or an error the router made). ``Relay``
is one upstream SSE stream being passed through chunk by chunk; its ``finish`` runs exactly
once however the stream ends (read to the end, broken upstream, client gone, server stopping)
and is the only place that returns the worker's in-flight slot and its connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from router.extract import RequestFacts
from router.metrics import RouterMetrics
from router.policies import RouteInfo
from router.workers import Worker

log = logging.getLogger("tandem.router")

Headers = list[tuple[bytes, bytes]]

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
                413: "RequestTooLargeError",
                502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}
# Not passed from the engine to the client: hop-by-hop, or set by our own server.
_DROP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                   b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"content-length", b"date",
                   b"server"})
_JSON = (b"content-type", b"application/json")


@dataclass
class RequestCtx:
    """One proxied request, as the proxy's attempts and the relay of its answer see it."""
    route: str
    path: str
    body: bytes
    headers: dict[str, str]
    rid: str
    facts: RequestFacts
    info: RouteInfo | None  # None: not routed by the policy (tokenize and similar)
    t0: float


def upstream_failed(metrics: RouterMetrics, w: Worker, outcome: str) -> None:
    """An exchange with ``w`` failed: its breaker and the per-worker outcome count hear of it."""
    w.breaker.record_failure()
    metrics.worker_requests.labels(w.url, outcome).inc()


def error_body(status: int, message: str, param: str | None = None) -> dict:
    etype = _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": etype, "param": param, "code": status}}


def sse_error(status: int, message: str) -> bytes:
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\ndata: [DONE]\n\n"


def upstream_headers(resp: aiohttp.ClientResponse, worker_id: str) -> Headers:
    out = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in _DROP]
    out.append((b"x-tandem-worker", worker_id.encode()))
    return out


@dataclass
class Answer:
    status: int
    body: bytes
    headers: Headers = field(default_factory=list)

    @classmethod
    def error(cls, status: int, message: str, param: str | None = None) -> Answer:
        headers = [_JSON]
        if status in (429, 503):
            headers.append((b"retry-after", b"1"))
        elif status == 405:
            headers.append((b"allow", b"POST"))
        return cls(status, json.dumps(error_body(status, message, param)).encode(), headers)

    async def send(self, send, rid: bytes) -> None:
        headers = [*self.headers, (b"content-length", str(len(self.body)).encode())]
        if rid:
            headers.append((b"x-request-id", rid))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


class Relay:
    """One upstream stream: the first chunk is already read (so retries were still possible)."""

    def __init__(self, metrics: RouterMetrics, ctx: RequestCtx, w: Worker, resp: aiohttp.ClientResponse,
                 first: bytes):
        self.metrics, self.ctx, self.w, self.resp, self.first = metrics, ctx, w, resp, first
        self.status = resp.status
        self.headers = upstream_headers(resp, w.id)
        self.complete = False
        self._done = False

    async def send(self, send, rid: bytes) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status,
                        "headers": [*self.headers, (b"x-request-id", rid)]})
            await self._pass_through(send)
            await send({"type": "http.response.body", "body": b""})
        finally:
            self.finish()

    async def _pass_through(self, send) -> None:
        m, ctx, w = self.metrics, self.ctx, self.w
        tail = b"\n\n"
        try:
            if self.first:
                tail = self.first[-2:]
                await send({"type": "http.response.body", "body": self.first, "more_body": True})
            async for chunk in self.resp.content.iter_any():
                tail = chunk[-2:] if len(chunk) >= 2 else tail[-1:] + chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.complete = True
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # After the first byte there is no retry: tell the client explicitly.
            upstream_failed(m, w, "stream_broken")
            m.stream_errors.labels(ctx.route).inc()
            log.warning("request %s: stream from %s broke mid-way: %s", ctx.rid, w.url, type(exc).__name__)
            self.status = 502
            if tail != b"\n\n":  # the engine died inside an event: close it so ours parses
                await send({"type": "http.response.body", "body": b"\n\n", "more_body": True})
            msg = f"upstream engine {w.id} failed mid-stream ({type(exc).__name__}); the output is incomplete"
            await send({"type": "http.response.body", "body": sse_error(502, msg), "more_body": True})

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        m, ctx = self.metrics, self.ctx
        self.w.inflight -= 1
        if not self.complete and self.status < 400:  # neither read to the end nor broken: the client left
            self.status = 499
            m.disconnects.labels(ctx.route).inc()
        if self.complete:
            self.resp.release()  # read to the end: the connection goes back to the pool
        else:
            self.resp.close()  # closing mid-stream drops the connection: the engine aborts
        m.requests.labels(ctx.route, str(self.status)).inc()
        m.duration.labels(ctx.route).observe(time.perf_counter() - ctx.t0)
