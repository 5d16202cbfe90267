"""A fake engine *HTTP* front for router tests, and a thread that serves any ASGI app.

``FakeEngine`` answers /health, /load, /v1/models and the three generation routes with a
deterministic echo. Knobs (read per request, change them at any time):
``status`` (answer every generation with this status), ``fail_next`` (the next N generation
requests get 503), ``break_after`` (a stream sends this many chunks, then the connection is
cut), ``chunk_delay_s``, ``json_delay_s`` (a non-streamed answer waits this long, watching
for the client leaving), ``chunks``, ``healthy``, ``running`` / ``waiting`` / ``kv`` (what
/load reports), ``vllm_like`` (no /load: the same gauges on /metrics under vLLM's names).
Every generation request is recorded as (path, headers, body) in ``seen``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.helpers.server import free_port


class FakeEngine:
    def __init__(self, name: str = "fake-model"):
        self.name = name
        self.status = 200
        self.fail_next = 0
        self.break_after: int | None = None
        self.chunk_delay_s = 0.0
        self.json_delay_s = 0.0
        self.chunks = 4
        self.healthy = True
        self.running = 0
        self.waiting = 0
        self.kv = 0.0
        self.vllm_like = False  # no /load; the gauges on /metrics under vLLM's names instead
        # Like the front's --api-key: Bearer required but on /health, /load, /metrics (everywhere
        # with keyed_ops, as --metrics-require-key).
        self.api_key: str | None = None
        self.keyed_ops = False
        self.seen: list[tuple[str, dict, dict]] = []
        self.disconnects = 0
        self.lock = threading.Lock()
        self.app = Starlette(middleware=[Middleware(_KeyCheck, engine=self)], routes=[
            Route("/health", self._health),
            Route("/load", self._load),
            Route("/metrics", self._metrics),
            Route("/v1/models", self._models),
            Route("/server_info", self._info),
            Route("/v1/completions", self._generate, methods=["POST"]),
            Route("/v1/chat/completions", self._generate, methods=["POST"]),
            Route("/generate", self._generate, methods=["POST"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
        ])

    async def _health(self, _: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    async def _metrics(self, _: Request) -> Response:
        lines = []
        for name, value in (("num_requests_running", self.running), ("num_requests_waiting", self.waiting),
                            ("kv_cache_usage_perc", self.kv)):
            lines += [f"# TYPE vllm:{name} gauge", f'vllm:{name}{{model_name="x"}} {value}']
        return Response("\n".join(lines) + "\n", media_type="text/plain")

    async def _load(self, _: Request) -> Response:
        if self.vllm_like:
            return Response(status_code=404)
        return JSONResponse({"server_load": self.running, "num_running_reqs": self.running,
                             "num_waiting_reqs": self.waiting, "kv_cache_usage_perc": self.kv})

    async def _models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def _info(self, _: Request) -> Response:
        return JSONResponse({"server": self.name})

    async def _tokenize(self, request: Request) -> Response:
        body = json.loads(await request.body())
        return JSONResponse({"tokens": [ord(c) for c in body.get("prompt", "")], "server": self.name})

    async def _generate(self, request: Request) -> Response:
        body = json.loads(await request.body() or b"{}")
        with self.lock:
            self.seen.append((request.url.path, dict(request.headers), body))
            fail = self.fail_next > 0
            self.fail_next -= 1 if fail else 0
        if fail or self.status != 200:
            status = 503 if fail else self.status
            return JSONResponse({"error": {"message": "fake failure", "type": "X", "param": None, "code": status}},
                                status_code=status)
        text = str(body.get("prompt", body.get("text", "")))[:16]
        if not body.get("stream"):
            deadline = time.monotonic() + self.json_delay_s
            while time.monotonic() < deadline:  # as an engine does: watch for the client leaving
                if await request.is_disconnected():
                    self.disconnects += 1
                    return Response(status_code=499)
                await asyncio.sleep(0.02)
            return JSONResponse({"object": "text_completion", "server": self.name,
                                 "choices": [{"index": 0, "text": text, "finish_reason": "stop"}]})
        return StreamingResponse(self._events(text, request), media_type="text/event-stream")

    async def _events(self, text: str, request: Request):
        try:
            for i in range(self.chunks):
                if self.break_after is not None and i == self.break_after:
                    raise RuntimeError("fake engine dies mid-stream")  # uvicorn drops the connection
                chunk = {"object": "text_completion", "server": self.name,
                         "choices": [{"index": 0, "text": f"{text}:{i}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnects += 1
            raise


class _KeyCheck:
    def __init__(self, app, engine: FakeEngine):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        key = self.engine.api_key
        probe = scope["path"] in ("/health", "/load", "/metrics") and not self.engine.keyed_ops
        if key is None or scope["type"] != "http" or probe \
                or dict(scope["headers"]).get(b"authorization") == f"Bearer {key}".encode():
            await self.app(scope, receive, send)
            return
        await JSONResponse({"error": {"code": 401}}, status_code=401)(scope, receive, send)


class ServerThread:
    """Serve an ASGI app with uvicorn in a daemon thread on a free loopback port."""

    def __init__(self, app, port: int | None = None, timeout: float = 20.0):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical", lifespan="auto",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10.0)


FAST = ["--health-check-interval-secs", "0.2", "--load-poll-interval-secs", "0.1", "--retry-initial-backoff-ms", "5",
        "--health-failure-threshold", "1", "--health-success-threshold", "1"]


class Stack:
    """An in-process router (``Router`` + its app in a thread) in front of ``n`` fake engines."""

    def __init__(self, n: int = 2, *flags: str, names: list[str] | None = None):
        from router.app import Router, build_app
        from router.config import parse_router_args

        self.fakes = [FakeEngine((names or ["m"] * n)[i]) for i in range(n)]
        self.ups = [ServerThread(f.app) for f in self.fakes]
        self.cfg = parse_router_args(["--worker-urls", *[u.url for u in self.ups], *FAST, *flags])
        self.router = Router(self.cfg)
        self.srv = ServerThread(build_app(self.router))
        self.url = self.srv.url

    def stop(self):
        self.srv.stop()
        for u in self.ups:
            u.stop()


def until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
