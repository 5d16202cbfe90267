"""The scheduler process: receive requests, plan steps, process results, stream outputs.

Overlap (docs/design.md §4): with depth 2 the scheduler sends plan N+1 right after plan N, from its
lagged view, then processes result N while the worker runs N+1. The default, depth 3, keeps
three steps launched, so the worker has plan N+2 in hand when it sends result N (the
scheduler's round trip leaves the step cycle of host-bound models). ``--disable-overlap-schedule``
sets depth 1 (plan, wait for its result, repeat). Every depth gives identical greedy tokens.
"""

from __future__ import annotations

import gc
import logging
import time

import msgspec
import zmq

from common.args import ServerArgs
from proto.messages import (
    AbortReq,
    EngineInfo,
    FlushCache,
    GenerateReq,
    Shutdown,
    StepOutputs,
    StepResult,
    WorkerError,
    WorkerReady,
)
from proto.transport import ChannelRefused, Endpoints, PullChannel, PushChannel
from scheduler_proc.core import SchedConfig, SchedulerCore
from scheduler_proc.planner import Planner

log = logging.getLogger("tandem.scheduler")
STATS_INTERVAL_S = 0.05
STATS_INTERVAL_MS = 50


class SchedulerLoop:
    def __init__(self, args: ServerArgs, ep: Endpoints):
        self.args = args
        self.ctx = zmq.Context()
        self.requests = PullChannel(self.ctx, "requests", ep.requests)
        self.results = PullChannel(self.ctx, "results", ep.results)
        self.plans = PushChannel(self.ctx, "plans", ep.plans)
        self.outputs = PushChannel(self.ctx, "outputs", ep.outputs)
        self.depth = args.step_depth
        self.running = True
        self.last_stats = 0.0
        self.last_sent: tuple = ()

    # ------------------------------------------------------------ start-up
    def wait_worker(self) -> WorkerReady:
        while True:
            msg = self.results.recv()
            if isinstance(msg, WorkerReady):
                return msg
            if isinstance(msg, WorkerError):
                raise RuntimeError(f"worker failed to start: {msg.message}")

    def start(self) -> None:
        ready = self.wait_worker()
        self.core = SchedulerCore(SchedConfig.from_ready(ready, self.args))
        self.planner = Planner(self.core)
        self.outputs.send(
            EngineInfo(
                max_context=ready.max_context,
                vocab_size=ready.vocab_size,
                page_size=ready.page_size,
                num_pages=ready.num_pages,
                max_running_requests=self.core.cfg.max_running,
                device=ready.device,
                dtype=ready.dtype,
                architecture=ready.architecture,
                speculative_num_steps=ready.speculative_num_steps,
                eos_token_ids=ready.eos_token_ids,
                kv_cache_dtype=ready.kv_cache_dtype,
                quantization=ready.quantization,
            )
        )
        log.info("scheduler ready: %d pages x %d tokens, %d slots", ready.num_pages, ready.page_size,
                 ready.max_slots)

    # ------------------------------------------------------------ loop
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.requests.sock, zmq.POLLIN)
        poller.register(self.results.sock, zmq.POLLIN)
        while self.running:
            t0 = time.perf_counter()
            self._drain_requests()
            if not self.running:  # Shutdown: forwarded to the worker; exit now, not after a poll
                break
            while len(self.core.inflight) < self.depth and (plan := self.planner.plan()) is not None:
                self.plans.send(plan)
            unreported = self._flush_outputs()
            self.core.counters.busy_s += time.perf_counter() - t0
            # A state change not yet reported (e.g. a release without output) is reported soon.
            events = dict(poller.poll(timeout=STATS_INTERVAL_MS if unreported else 1000))
            t0 = time.perf_counter()
            if self.results.sock in events:
                self._drain_results()
            self.core.counters.busy_s += time.perf_counter() - t0

    def _drain_requests(self) -> None:
        while (msg := self._recv(self.requests)) is not None:
            if isinstance(msg, GenerateReq):
                self.core.add_request(msg)
            elif isinstance(msg, AbortReq):
                self.core.abort(msg)
            elif isinstance(msg, FlushCache):
                n = self.core.alloc.flush()
                log.info("prefix cache flushed (%d pages)", n)
            elif isinstance(msg, Shutdown):
                self.running = False
                self.plans.send(Shutdown(msg.reason))

    def _drain_results(self) -> None:
        while (msg := self._recv(self.results)) is not None:
            if isinstance(msg, StepResult):
                self.core.on_result(msg)
            elif isinstance(msg, WorkerError):
                raise RuntimeError(f"worker error: {msg.message}")

    def _recv(self, chan: PullChannel):
        try:
            return chan.recv(timeout_ms=0)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("dropping malformed %s frame: %s", chan.channel, exc)
            return self._recv(chan)

    def _flush_outputs(self) -> bool:
        """Send pending outputs, and the stats when they changed (throttled while busy, at once
        on going idle). Returns True while a change is left unreported."""
        outs = self.core.take_outputs()
        if outs:
            self.outputs.send(StepOutputs(outs))
        stats = self.core.stats()
        gauges = (stats.num_running, stats.num_waiting, stats.kv_pages_used, stats.steps, stats.requests_received,
                  stats.num_slots_held)
        if gauges == self.last_sent:
            return False
        now = time.monotonic()
        if now - self.last_stats > STATS_INTERVAL_S or self.core.idle():
            self.outputs.send(stats)
            self.last_stats, self.last_sent = now, gauges
            return False
        return True

    def close(self) -> None:
        for chan in (self.requests, self.results, self.plans, self.outputs):
            chan.close()
        self.ctx.term()


def run(args: ServerArgs, endpoints: Endpoints, status_conn=None) -> None:
    """Process entry point (spawned by the supervisor)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    loop = SchedulerLoop(args, endpoints)
    try:
        try:
            loop.start()
        except RuntimeError as exc:  # the worker could not start: it already said why
            log.error("%s", exc)
            raise SystemExit(1) from None
        gc.collect()
        gc.freeze()  # start-up state lives for the whole process: keep it out of GC passes
        loop.run()
    except ChannelRefused as exc:  # a tcp:// peer with other keys: one line, not a hang or a traceback
        log.error("%s", exc)
        raise SystemExit(1) from None
    finally:
        loop.close()
