"""Waiting for engine output on behalf of one HTTP request, and noticing when its client leaves.

``RequestGroup`` owns the engine requests of one HTTP request (``n`` choices x prompts). Whatever
way the request ends — finished, client disconnect, handler error, cancellation — ``close()``
aborts the engine requests that are still running, so no request keeps decoding for nobody.

Disconnects are seen on the ASGI receive channel (``http.disconnect``), both while streaming and
while a non-streaming handler waits: a watcher task races the output wait.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenizer_proc.engine_client import EngineClient
from tokenizer_proc.request_state import Delta, RequestState, TokenLogprob

log = logging.getLogger("tandem.front")
_encoder = msgspec.json.Encoder()
DONE_EVENT = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    pass


def sse(payload: dict) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


@dataclass
class ChoiceResult:
    """A whole choice, accumulated for non-streaming responses."""

    state: RequestState
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_code: int = 0

    def add(self, d: Delta) -> None:
        self.text.append(d.text)
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        if d.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
            self.error, self.error_code = d.error, d.error_code


class RequestGroup:
    def __init__(self, engine: EngineClient, states: list[RequestState], internal: bool = False):
        self.engine = engine
        self.states = states
        self.sink = engine.submit(states, internal=internal)  # may raise APIError (503 / 400)
        self.remaining = len(states)

    @property
    def done(self) -> bool:
        return self.remaining == 0

    async def next_batch(self) -> list[Delta]:
        """At least one Delta; everything already queued comes along (a slow reader coalesces)."""
        batch = [await self.sink.get()]
        while not self.sink.empty():
            batch.append(self.sink.get_nowait())
        self.remaining -= sum(1 for d in batch if d.finished)
        return batch

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        while not self.done:
            yield await self.next_batch()

    async def collect(self) -> list[ChoiceResult]:
        results = {s.rid: ChoiceResult(s) for s in self.states}
        async for batch in self.deltas():
            for d in batch:
                results[d.state.rid].add(d)
        return [results[s.rid] for s in self.states]

    def close(self, reason: str = "client_disconnect") -> None:
        for state in self.engine.pending(self.states):
            self.engine.abort(state, reason)


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable):
    """Await ``work``; raise ClientDisconnected if the client hangs up first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        raise ClientDisconnected()
    finally:
        for task in (work_task, watch_task):
            if not task.done():
                task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)


async def collect_or_abort(request: Request, group: RequestGroup) -> list[ChoiceResult]:
    try:
        return await run_until_disconnect(request, group.collect())
    finally:
        group.close()


class SSEResponse(Response):
    """Server-sent events from an async iterator of encoded events.

    Unlike StreamingResponse, the disconnect watcher runs whatever the ASGI spec version, and
    ``on_close`` always runs (it aborts the engine requests the stream did not finish).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        # Not Response.__init__: that would render an empty body and send Content-Length: 0.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.on_close = on_close

    async def _pump(self, send: Send) -> None:
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                if not task.done():
                    task.cancel()
            results = await asyncio.gather(pump, watch, return_exceptions=True)
            self.on_close()
            if isinstance(results[0], Exception) and not isinstance(results[0], OSError):
                log.error("stream failed: %r", results[0])
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
