"""Prometheus metrics with vLLM's names, suffixes and buckets under the ``tandem:`` prefix.

Everything is computed in this process from engine outputs (as vLLM does in its API server):
request latencies from our own monotonic clock, scheduler gauges and cumulative counters from
``SchedulerStats``. ``--metrics-compat vllm`` registers a ``vllm:`` copy of every series so vLLM's
Grafana dashboard, GIE/llm-d and ``vllm bench serve`` work unchanged.

``_created`` series are switched off: they broke ``vllm bench serve``'s spec-decode parser.
Inter-token latency is recorded per token (an output carrying k tokens after dt gives k samples
of dt/k, SGLang's rule), so speculative decoding does not look like slow single tokens.
"""

from __future__ import annotations

from typing import Any, Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from proto.messages import ReqTimings, SchedulerStats

prometheus_client.disable_created_metrics()

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def buckets_1_2_5(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out, mantissas, exp = [], (1, 2, 5), 0
    while True:
        for m in mantissas:
            value = m * 10**exp
            if value > max_value:
                return out
            out.append(value)
        exp += 1


class _Fan:
    """One logical metric fanned out to the same series under every prefix."""

    def __init__(self, children: list[Any]):
        self.children = children

    def labels(self, **labels: str) -> _Fan:
        return _Fan([c.labels(**labels) for c in self.children])

    def inc(self, amount: float = 1.0) -> None:
        for c in self.children:
            c.inc(amount)

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


class Metrics:
    def __init__(self, model_name: str, compat: str | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.prefixes = ["tandem:"] + (["vllm:"] if compat == "vllm" else [])
        self.model_name = model_name
        self._last: SchedulerStats | None = None
        self._token_hists: tuple[_Fan, _Fan] | None = None
        g, c, h = self._gauge, self._counter, self._hist
        self.running = g("num_requests_running", "Requests in the running batch")
        self.waiting = g("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = g("kv_cache_usage_perc", "KV-cache usage, 0 to 1")
        self.prefix_queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = c("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = c("num_preemptions", "Cumulative preemptions")
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = c("generation_tokens", "Generation tokens produced")
        self.success = c("request_success", "Finished requests by finish reason", ("finished_reason",))
        self.ttft = h("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Inter-token latency, one sample per token", ITL_BUCKETS)
        self.tpot = h("request_time_per_output_token_seconds", "Mean time per output token, per request",
                      ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Arrival to last token", LATENCY_BUCKETS)
        self.queue = h("request_queue_time_seconds", "Time waiting in the scheduler queue", LATENCY_BUCKETS)
        self.prefill = h("request_prefill_time_seconds", "First scheduled to first token", LATENCY_BUCKETS)
        self.decode = h("request_decode_time_seconds", "First token to last token", LATENCY_BUCKETS)
        self.inference = h("request_inference_time_seconds", "First scheduled to last token", LATENCY_BUCKETS)
        self.spec_drafts = c("spec_decode_num_drafts", "Speculative draft rounds")
        self.spec_draft_tokens = c("spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.spec_accepted = c("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_per_pos = c("spec_decode_num_accepted_tokens_per_pos", "Accepted drafts by position",
                              ("position",))
        self.gpu_busy = c("gpu_busy_seconds", "Device-busy time of engine steps (CUDA events; CPU: compute time)")
        self.gpu_gap = c("gpu_idle_between_steps_seconds",
                         "Device idle between consecutive steps of continuing work (the process-boundary cost)")
        self.rejected = c("request_rejected",
                          "Requests refused at admission (503): overload, starting, draining, dead", ("reason",))
        self.engine_restarts = c("engine_restarts", "Engine (scheduler + worker) restarts after a failure")
        for reason in FINISH_REASONS:  # present from the start, so rate() works on the first request
            self.success.labels(model_name=model_name, finished_reason=reason)
        self.rejected.labels(model_name=model_name, reason="overload")

    # ------------------------------------------------------------------ construction
    def _make(self, cls: type, name: str, doc: str, labels: Iterable[str] = (), **kw: Any) -> _Fan:
        names = ("model_name", *labels)
        metrics = [cls(p + name, doc, names, registry=self.registry, **kw) for p in self.prefixes]
        return _Fan(metrics)

    def _bind(self, fan: _Fan, extra_labels: tuple[str, ...]) -> Any:
        # Children keyed only by model_name are bound once; the rest stay families.
        return fan if extra_labels else fan.labels(model_name=self.model_name)

    def _gauge(self, name: str, doc: str) -> _Fan:
        return self._bind(self._make(Gauge, name, doc, multiprocess_mode="mostrecent"), ())

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> _Fan:
        return self._bind(self._make(Counter, name, doc, labels), labels)

    def _hist(self, name: str, doc: str, buckets: Iterable[float]) -> _Fan:
        return self._bind(self._make(Histogram, name, doc, buckets=list(buckets)), ())

    def set_max_model_len(self, max_len: int) -> None:
        """Token-count histograms need the context length for their buckets (known at EngineInfo)."""
        if self._token_hists is None:
            b = buckets_1_2_5(max(1, max_len))
            self._token_hists = (
                self._hist("request_prompt_tokens", "Prompt tokens per request", b),
                self._hist("request_generation_tokens", "Generation tokens per request", b),
            )

    # ------------------------------------------------------------------ engine stats
    def on_stats(self, s: SchedulerStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0)
        last = self._last
        self._last = s
        for fan, attr in (
            (self.prefix_queries, "prefix_queries"),
            (self.prefix_hits, "prefix_hits"),
            (self.preemptions, "num_preemptions"),
            (self.spec_drafts, "spec_num_drafts"),
            (self.spec_draft_tokens, "spec_num_draft_tokens"),
            (self.spec_accepted, "spec_num_accepted_tokens"),
        ):
            fan.inc(_delta(getattr(s, attr), getattr(last, attr) if last else 0))
        for fan, attr in ((self.gpu_busy, "worker_busy_s"), (self.gpu_gap, "worker_gap_s")):
            fan.inc(_delta(getattr(s, attr), getattr(last, attr) if last else 0.0))
        prev = last.spec_accepted_per_pos if last else ()
        for pos, value in enumerate(s.spec_accepted_per_pos):
            before = prev[pos] if pos < len(prev) else 0
            self.spec_per_pos.labels(model_name=self.model_name, position=str(pos)).inc(_delta(value, before))

    # ------------------------------------------------------------------ per request
    def on_tokens(self, k: int, dt: float | None, ttft: float | None) -> None:
        """k tokens arrived; dt since the previous output (None for the first), ttft on the first."""
        if k <= 0:
            return
        self.generation_tokens.inc(k)
        if ttft is not None:
            self.ttft.observe(ttft)
        elif dt is not None:
            per_token = dt / k
            for _ in range(k):
                self.itl.observe(per_token)

    def on_finish(
        self,
        reason: str,
        prompt_tokens: int,
        gen_tokens: int,
        e2e: float,
        ttft: float | None,
        timings: ReqTimings | None,
    ) -> None:
        self.success.labels(model_name=self.model_name, finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e.observe(e2e)
        if ttft is not None and gen_tokens > 1:
            self.tpot.observe((e2e - ttft) / (gen_tokens - 1))
        if timings is not None:
            self.on_timings(timings)
        if self._token_hists is not None:
            self._token_hists[0].observe(prompt_tokens)
            self._token_hists[1].observe(gen_tokens)

    def on_timings(self, timings: ReqTimings) -> None:
        """The scheduler's view of one finished request (it comes with the engine's final output,
        which for a request the front ended itself arrives after ``on_finish``)."""
        self.queue.observe(timings.queue_s)
        self.prefill.observe(timings.prefill_s)
        self.decode.observe(timings.decode_s)
        self.inference.observe(timings.prefill_s + timings.decode_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _delta(now: float, before: float) -> float:
    """Counter increments from cumulative values; a restarted engine starts again from zero."""
    return now - before if now >= before else now
