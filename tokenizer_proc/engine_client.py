"""The front's side of the engine: ZMQ sockets, in-flight requests, and the output loop.

One task reads the ``outputs`` channel and, for each ReqOutput, runs the request's detokenizer
and stop matcher right there (``RequestState.apply``) and queues the resulting Delta for the
HTTP handler. Doing it in one place means a stop string aborts the engine request within the
same step, and metrics see every token exactly once.

Life cycle (``phase``): starting -> ready -> draining, or -> dead on EngineDead (and back to
starting when a restarted engine announces itself). Only ``ready`` accepts requests; the others
answer 503.

Admission (``--max-queued-requests`` N counts *waiting* requests, not running ones): the
estimate is the scheduler's last reported ``num_waiting`` plus every GenerateReq sent that the
scheduler had not read yet when it made that report (``requests_received`` is cumulative),
less the slots free for them: those that report left free or held by finished requests (the
scheduler frees those within a step and fills slots first; not counted when slots were free
and requests still waited, i.e. KV pages were the limit), and one per request that has left
the engine since (a final output after the report; outputs and stats share one ordered
channel). Without these, a client that sends its next request the moment its last one ended
got a 503 with the engine at exactly N waiting, for up to one stats interval.
Check and send happen synchronously (no await between them), so a burst cannot overshoot N
while slots are the limit; when KV pages are, the scheduler's backstop (N + max running)
still holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Callable, Iterable

import msgspec
import zmq
import zmq.asyncio

from common.args import ServerArgs
from proto.arrays import pack_i32
from proto.messages import (
    AbortReq,
    EngineDead,
    EngineInfo,
    FlushCache,
    GenerateReq,
    ReqOutput,
    SchedulerStats,
    Shutdown,
    StepOutputs,
)
from proto.transport import AsyncPullChannel, AsyncPushChannel, ChannelRefused, Endpoints
from tokenizer_proc.errors import APIError
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.request_state import Delta, RequestState

log = logging.getLogger("tandem.front")

STARTING, READY, DRAINING, DEAD = "starting", "ready", "draining", "dead"
LATE_TIMINGS_MAX = 4096


class EngineClient:
    def __init__(self, args: ServerArgs, endpoints: Endpoints, metrics: Metrics):
        self.args = args
        self.endpoints = endpoints
        self.metrics = metrics
        self.ctx = zmq.asyncio.Context()
        self.outputs: AsyncPullChannel | None = None
        self.requests: AsyncPushChannel | None = None
        self.states: dict[str, RequestState] = {}
        # Requests the front ended itself (stop string, disconnect) whose engine request has not
        # sent its final output yet: that output carries the scheduler timings (queue, prefill,
        # decode) the latency histograms still need.
        self.late: OrderedDict[str, bool] = OrderedDict()
        self.info: EngineInfo | None = None
        self.info_event = asyncio.Event()
        self.last_stats: SchedulerStats | None = None
        self.phase = STARTING
        self.dead_reason: str | None = None
        self.started_at = time.time()
        self._task: asyncio.Task | None = None
        self.on_restart: Callable[[], None] | None = None  # set by the server
        self.sent_generate = 0  # GenerateReqs sent to the current engine (admission estimate)
        self.finished_since_stats = 0  # final outputs received after the last SchedulerStats

    # ------------------------------------------------------------------ sockets
    def open(self) -> None:
        """Bind outputs (we own that address) and connect to the scheduler's requests PULL."""
        self.outputs = AsyncPullChannel(self.ctx, "outputs", self.endpoints.outputs)
        self.requests = AsyncPushChannel(self.ctx, "requests", self.endpoints.requests)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._recv_loop(), name="engine-outputs")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing anyway
                pass
        for chan in (self.outputs, self.requests):
            if chan is not None:
                chan.close()
        self.ctx.term()

    def send(self, msg) -> None:
        assert self.requests is not None
        try:
            self.requests.send_nowait(msg)
        except ChannelRefused as exc:  # a tcp:// scheduler with other keys: nothing will ever arrive
            if self.phase != DEAD:
                self.on_engine_dead(str(exc))

    # ------------------------------------------------------------------ admission
    @property
    def num_inflight(self) -> int:
        return len(self.states)

    def check_accepting(self) -> None:
        """Ready and not overloaded, else 503 (handlers call it before tokenizing, so refusing a
        burst costs no tokenizer time; ``submit`` checks again with the real count)."""
        if self.phase == READY:
            self.check_capacity(1)
            return
        self._count_rejected(self.phase)
        if self.phase == DEAD:
            raise APIError(503, f"engine is dead: {self.dead_reason}")
        if self.phase == DRAINING:
            raise APIError(503, "server is shutting down")
        raise APIError(503, "server is starting up")

    def _count_rejected(self, reason: str) -> None:
        self.metrics.rejected.labels(model_name=self.metrics.model_name, reason=reason).inc()

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the scheduler's queue plus those on their way there, less
        the ones the free running slots will take at once (the scheduler fills slots first)."""
        return self._waiting_with(0)

    def _waiting_with(self, n: int) -> int:
        """``num_waiting`` if ``n`` more requests were sent now."""
        stats = self.last_stats
        waiting = stats.num_waiting if stats else 0
        in_transit = max(0, self.sent_generate - (stats.requests_received if stats else 0)) + n
        free_slots = self.finished_since_stats
        if self.info is not None:
            slots, running = self.info.max_running_requests, stats.num_running if stats else 0
            # Slots the report left free, or held by finished requests (freed within a step):
            # theirs unless KV pages, not slots, were what held the queue back.
            if waiting == 0 or (stats is not None and stats.num_slots_held >= slots):
                free_slots += max(0, slots - running)
        return max(0, waiting + in_transit - free_slots)

    @property
    def num_running(self) -> int:
        return self.last_stats.num_running if self.last_stats else 0

    def check_capacity(self, n: int = 1) -> None:
        """503 + Retry-After when ``n`` more requests would leave more than --max-queued-requests
        waiting; 400 when ``n`` could never fit (more than max running + that limit)."""
        limit = self.args.max_queued_requests
        if self.info is not None and n > self.info.max_running_requests + limit:
            raise APIError(400, f"n={n} choices can never be scheduled here (max running requests "
                                f"{self.info.max_running_requests} + --max-queued-requests {limit})", "n")
        if self._waiting_with(n) > limit:
            self._count_rejected("overload")
            raise APIError(503, f"server overloaded: {self.num_waiting} requests waiting (--max-queued-requests "
                                f"{limit}); retry later")

    def submit(self, states: list[RequestState], internal: bool = False) -> asyncio.Queue:
        """Register and send; returns the queue that receives every Delta of these states."""
        if not internal:
            self.check_accepting()
            self.check_capacity(len(states))
        elif self.phase == DEAD:
            raise APIError(503, f"engine is dead: {self.dead_reason}")
        for s in states:
            # A rid whose abort the engine has not answered yet is still in use: reusing it
            # would hand the old request's final output to the new one.
            if s.rid in self.states or s.rid in self.late:
                raise APIError(400, f"request id {s.rid!r} is already in use", "rid")
        sink: asyncio.Queue = asyncio.Queue()
        for s in states:
            s.sink = sink
            self.states[s.rid] = s
            self.send(GenerateReq(s.rid, pack_i32(s.prompt_ids), s.params, s.arrival_wall))
            self.sent_generate += 1
            if self.phase == DEAD:  # the send found the engine unreachable: it failed what it held
                for t in states:
                    self.states.pop(t.rid, None)
                raise APIError(503, f"engine is dead: {self.dead_reason}")
        return sink

    def abort(self, state: RequestState, reason: str = "client_disconnect") -> None:
        """Client went away (or shutdown): tell the scheduler at once so it frees the KV."""
        if self.states.pop(state.rid, None) is None:
            return
        self.send(AbortReq(state.rid, reason))
        if not state.finished:
            self._finish_metrics(state.abort(), time.monotonic())
            self._await_timings(state)

    def flush_cache(self) -> None:
        self.send(FlushCache())

    def fail_all(self, message: str, status: int = 503, abort_reason: str | None = None) -> None:
        """Engine dead or shutting down: every in-flight request ends now with an error."""
        now = time.monotonic()
        self.late.clear()  # a dead or stopping engine sends no more final outputs
        for rid, state in list(self.states.items()):
            del self.states[rid]
            if abort_reason is not None:
                self.send(AbortReq(rid, abort_reason))
            delta = state.fail(message, status)
            self._finish_metrics(delta, now)
            state.sink.put_nowait(delta)

    def shutdown_engine(self, reason: str) -> None:
        self.send(Shutdown(reason))

    # ------------------------------------------------------------------ output loop
    async def _recv_loop(self) -> None:
        assert self.outputs is not None
        while True:
            try:
                msg = await self.outputs.recv()
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.error("dropping malformed outputs frame: %s", exc)
                continue
            try:
                self._dispatch(msg)
            except Exception:  # noqa: BLE001 - one bad output must not kill the loop
                log.exception("error while processing %s", type(msg).__name__)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, StepOutputs):
            now = time.monotonic()
            for out in msg.outputs:
                if out.finish_reason is not None:
                    self.finished_since_stats += 1
                self._on_output(out, now)
        elif isinstance(msg, SchedulerStats):
            self.last_stats, self.finished_since_stats = msg, 0
            self.metrics.on_stats(msg)
        elif isinstance(msg, EngineInfo):
            restarted = self.phase == DEAD
            self.info = msg
            self.metrics.set_max_model_len(msg.max_context)
            self.info_event.set()
            if restarted:
                # A fresh engine: its counters start from zero.
                self.sent_generate, self.last_stats, self.finished_since_stats = 0, None, 0
                self.metrics.engine_restarts.inc()
            if restarted and self.on_restart is not None:
                # A supervisor that restarts the engine: warm up again before serving.
                self.phase, self.dead_reason = STARTING, None
                self.on_restart()
        elif isinstance(msg, EngineDead):
            self.on_engine_dead(msg.reason)

    def on_engine_dead(self, reason: str) -> None:
        log.error("engine dead: %s", reason)
        self.phase = DEAD
        self.dead_reason = reason
        self.info_event.set()  # wake a start-up that is still waiting for EngineInfo
        self.fail_all(f"engine is dead: {reason}", 503)
        # Nothing runs or waits on a dead engine: /load and the gauges say so until it is back.
        self.last_stats, self.finished_since_stats = None, 0
        self.metrics.running.set(0)
        self.metrics.waiting.set(0)
        self.metrics.kv_usage.set(0.0)

    def _on_output(self, out: ReqOutput, now: float) -> None:
        state = self.states.get(out.rid)
        if state is None:
            # Finished here already (stop string, disconnect): the engine's echo of it, whose final
            # output still brings the scheduler's timings.
            if out.finish_reason is not None and self.late.pop(out.rid, False) and out.timings is not None:
                self.metrics.on_timings(out.timings)
            return
        delta = state.apply(out)
        if delta is None:
            return
        self._token_metrics(state, len(delta.token_ids), now)
        if delta.finished:
            del self.states[out.rid]
            if state.stopped_by_string and out.finish_reason is None:
                self.send(AbortReq(out.rid, "stop_string"))
                self._await_timings(state)
            self._finish_metrics(delta, now)
        state.sink.put_nowait(delta)

    def _await_timings(self, state: RequestState) -> None:
        if state.internal:
            return
        self.late[state.rid] = True
        while len(self.late) > LATE_TIMINGS_MAX:  # never unbounded, whatever the engine does
            self.late.popitem(last=False)

    # ------------------------------------------------------------------ metrics
    def _token_metrics(self, state: RequestState, k: int, now: float) -> None:
        if k == 0:
            return
        first = state.first_token_mono is None
        if not state.internal:
            dt = None if first else now - (state.last_token_mono or now)
            self.metrics.on_tokens(k, dt, now - state.arrival_mono if first else None)
        if first:
            state.first_token_mono = now
        state.last_token_mono = now

    def _finish_metrics(self, delta: Delta, now: float) -> None:
        state = delta.state
        if state.internal:
            return
        ttft = None if state.first_token_mono is None else state.first_token_mono - state.arrival_mono
        end = state.last_token_mono or now
        self.metrics.on_finish(
            delta.finish_reason or "abort", state.prompt_tokens, state.n_tokens, end - state.arrival_mono, ttft,
            state.timings,
        )

    # ------------------------------------------------------------------ helpers for handlers
    def pending(self, states: Iterable[RequestState]) -> list[RequestState]:
        return [s for s in states if s.rid in self.states]
