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
import logging
import random
import time
import uuid

import aiohttp
from starlette.responses import JSONResponse

from router.answer import Answer, Relay, RequestCtx, error_body, upstream_failed, upstream_headers
from router.config import RouterConfig
from router.extract import read_facts
from router.metrics import RouterMetrics
from router.policies import Policy, RouteInfo, least_loaded
from router.workers import Worker, WorkerRegistry

log = logging.getLogger("tandem.router")

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                          "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length"})


def error_response(status: int, message: str, rid: str, param: str | None = None) -> JSONResponse:
    """The same error shape for the router's own (framework-served) routes."""
    headers = {"x-request-id": rid}
    if status in (429, 503):
        headers["Retry-After"] = "1"
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


class _Retry(Exception):
    """This attempt failed before anything reached the client."""

    def __init__(self, reason: str, status: int = 502, answer: Answer | None = None):
        super().__init__(reason)
        self.status = status
        self.answer = answer  # the upstream's own answer, returned if retries run out


class _Gone:
    """Set by the disconnect watcher; ``done`` once the whole answer is sent (after that,
    uvicorn's receive() also says disconnect, and nothing must be cancelled)."""

    __slots__ = ("gone", "done")

    def __init__(self):
        self.gone = self.done = False


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
    async def serve(self, scope, receive, send, route: str, routed: bool = True) -> None:
        """Serve one proxied request on raw ASGI. One watcher task per request: a client that
        leaves cancels this task, wherever it waits (upstream, retry back-off, mid-stream)."""
        t0 = time.perf_counter()
        try:
            body = await _read_body(receive, self.cfg.max_request_body_bytes)
        except _TooLarge:
            limit = self.cfg.max_request_body_bytes
            self.metrics.requests.labels(route, "413").inc()
            await Answer.error(413, f"request body larger than {limit} bytes (--max-request-body-bytes)").send(
                send, self._request_id(scope).encode("latin-1"))
            return
        if body is None:  # gone before its body arrived
            self.metrics.disconnects.labels(route).inc()
            return
        rid = self._request_id(scope)
        facts = read_facts(route, body, self.cfg.cache.max_prefix_chars)
        headers = _forward_headers(scope, rid)
        key = next((headers[h] for h in self.cfg.routing_key_headers if h in headers), facts.user)
        ctx = RequestCtx(route, scope["path"], body, headers, rid, facts,
                   RouteInfo(facts.text, key) if routed else None, t0)
        me = asyncio.current_task()
        flag = _Gone()
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, me, flag))
        answer: Answer | Relay | None = None
        try:
            try:
                answer = await self._with_retries(ctx)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a router bug answers 500, it never drops the request
                log.exception("request %s: router error", rid)
                answer = self._final(ctx, Answer.error(500, "router internal error"), "internal")
            await answer.send(send, rid.encode("latin-1"))
            flag.done = True
        except asyncio.CancelledError:
            if not flag.gone:
                raise  # the server is stopping: _attempt / Relay.finish take the upstream down
            me.uncancel()
            if answer is None:  # the client left before the answer started
                self.metrics.disconnects.labels(route).inc()
                self.metrics.requests.labels(route, "499").inc()
            elif isinstance(answer, Relay):
                answer.finish()  # idempotent; counts the 499 and drops the upstream connection
        finally:
            watcher.cancel()

    def _request_id(self, scope) -> str:
        wanted = self.cfg.request_id_headers
        for k, v in scope["headers"]:  # raw ASGI pairs
            if v and k.decode("latin-1") in wanted:
                return v.decode("latin-1")[:256]
        return uuid.uuid4().hex

    # ------------------------------------------------------------------ attempts
    async def _with_retries(self, ctx: RequestCtx) -> Answer | Relay:
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
                model = ctx.facts.model
                if model is not None and self.registry.available() and not self.registry.available(model):
                    return self._final(ctx, Answer.error(404, f"The model `{ctx.facts.model}` does not exist.",
                                                         "model"), "model_not_found")
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
        if last.answer is not None:
            return self._final(ctx, last.answer, "upstream_error")
        return self._final(ctx, Answer.error(last.status, f"request failed after {tries} attempt(s): {last}"),
                           "retries_exhausted")

    def _final(self, ctx: RequestCtx, answer: Answer, reason: str) -> Answer:
        self.metrics.errors.labels(ctx.route, reason).inc()
        self.metrics.requests.labels(ctx.route, str(answer.status)).inc()
        self.metrics.duration.labels(ctx.route).observe(time.perf_counter() - ctx.t0)
        return answer

    def _backoff(self, n: int) -> float:
        r = self.cfg.retry
        base = min(r.max_backoff_ms, r.initial_backoff_ms * r.backoff_multiplier ** (n - 1))
        return base * self._rng.uniform(1 - r.jitter_factor, 1 + r.jitter_factor) / 1000.0

    def _pick(self, ctx: RequestCtx, failed: set[str]) -> Worker | None:
        workers = self.registry.available(ctx.facts.model)
        fresh = [w for w in workers if w.url not in failed]
        workers = fresh or workers
        if not workers:
            return None
        if ctx.info is None:
            return least_loaded(workers)
        return self.policy.select(workers, ctx.info)

    async def _attempt(self, ctx: RequestCtx, w: Worker) -> Answer | Relay:
        w.inflight += 1
        handed_off = False
        resp: aiohttp.ClientResponse | None = None
        try:
            try:
                resp = await self.client.post(w.url + ctx.path, data=ctx.body, headers=ctx.headers)
            except aiohttp.ClientConnectorError as exc:
                self.upstream_failed(w, "connect_error")
                if w.eject(f"connection refused: {exc}"):
                    log.warning("worker %s refused a connection: out of rotation", w.url)
                self._on_refused(w)
                raise _Retry(f"cannot connect to {w.url}") from None
            except asyncio.TimeoutError:
                self.upstream_failed(w, "timeout")
                raise _Retry(f"{w.url} timed out", 504) from None
            except aiohttp.ClientError as exc:
                self.upstream_failed(w, "transport_error")
                raise _Retry(f"{w.url}: {type(exc).__name__}") from None
            status = resp.status
            if status in RETRYABLE_STATUS:
                data = await self._read_quietly(resp)
                self.upstream_failed(w, f"status_{status}")
                raise _Retry(f"{w.url} answered {status}", status, Answer(status, data, upstream_headers(resp, w.id)))
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

    async def _whole(self, ctx: RequestCtx, w: Worker, resp: aiohttp.ClientResponse) -> Answer:
        try:
            data = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.upstream_failed(w, "read_error")
            raise _Retry(f"{w.url}: broken answer ({type(exc).__name__})") from None
        resp.release()
        w.inflight -= 1
        elapsed = time.perf_counter() - ctx.t0
        self.metrics.ttft.labels(ctx.route).observe(elapsed)
        self.metrics.duration.labels(ctx.route).observe(elapsed)
        self.metrics.requests.labels(ctx.route, str(resp.status)).inc()
        return Answer(resp.status, data, upstream_headers(resp, w.id))

    async def _stream(self, ctx: RequestCtx, w: Worker, resp: aiohttp.ClientResponse) -> Relay:
        chunks = resp.content.iter_any()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.upstream_failed(w, "read_error")
            raise _Retry(f"{w.url}: stream broke before its first byte ({type(exc).__name__})") from None
        self.metrics.ttft.labels(ctx.route).observe(time.perf_counter() - ctx.t0)
        return Relay(self.metrics, ctx, w, resp, first)

    # ------------------------------------------------------------------ helpers
    def upstream_failed(self, w: Worker, outcome: str) -> None:
        upstream_failed(self.metrics, w, outcome)

    @staticmethod
    async def _read_quietly(resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await asyncio.wait_for(resp.read(), 5.0)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return b""


def _forward_headers(scope, rid: str) -> dict[str, str]:
    """The client's headers minus hop-by-hop ones, with the request id set."""
    out = {}
    for k, v in scope["headers"]:
        name = k.decode("latin-1")
        if name not in _HOP_HEADERS:
            out[name] = v.decode("latin-1")
    out["x-request-id"] = rid
    return out


class _TooLarge(Exception):
    pass


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None when the client disconnected first; _TooLarge past
    ``limit`` bytes (counted as they arrive: a chunked body has no Content-Length)."""
    parts = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        parts.append(msg.get("body", b""))
        size += len(parts[-1])
        if size > limit:
            raise _TooLarge
        if not msg.get("more_body"):
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def _watch_disconnect(receive, task: asyncio.Task, flag: _Gone) -> None:
    """The body is read already, so receive() returns only when the client goes away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not flag.done:
                flag.gone = True
                task.cancel()
            return
