#!/usr/bin/env python3
"""Writes dashboards/tandem.json, the Grafana dashboard of the Tandem stack.

The dashboard is generated so that every panel is one short line here (title, unit, queries)
and the JSON stays consistent (ids, grid, datasource). Run it after editing; the unit test
tests/unit/deploy/test_deploy_files.py fails when the committed JSON differs from what this writes,
and tests/e2e/test_deploy_stack.py evaluates every query below in a live Prometheus.

    python deploy/grafana/make_dashboard.py           # rewrite the JSON
    python deploy/grafana/make_dashboard.py --check   # exit 1 if it is stale

Metric names: engine series are ``tandem:*`` (tokenizer_proc/metrics.py, vLLM's suffixes);
router series are ``tandem_router_*`` (router/metrics.py). ``engine`` is the label that
prometheus.yml (compose) or the PodMonitor (Kubernetes) puts on each engine's series.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dashboards", "tandem.json")
DS = {"type": "prometheus", "uid": "prometheus"}  # provisioning/datasources/prometheus.yml
SEL = 'engine=~"$engine",model_name=~"$model_name"'  # every engine query is filtered by both
RI = "$__rate_interval"
# For router counters that the router creates on their first event (a retry, a failed answer):
# without it such a panel shows "No data" until the first failure, instead of 0.
ZERO = " or on() vector(0)"


def rate(metric: str, extra: str = "") -> str:
    sel = SEL + ("," + extra if extra else "")
    return f"rate({metric}{{{sel}}}[{RI}])"


def quantile(q: float, hist: str, by: str = "engine") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) ({rate(hist + '_bucket')}))"


def router_quantile(q: float, hist: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({hist}_bucket[{RI}])))"


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""
    width: int = 8
    kind: str = "timeseries"
    mappings: tuple = ()
    extra: dict = field(default_factory=dict)


ROWS: list[tuple[str, list[Panel]]] = [
    ("Requests", [
        Panel("Request rate", "reqps", (
            (f"sum by (engine) ({rate('tandem:request_success_total')})", "{{engine}}"),
        ), "Finished requests per second, per engine (every finish reason)."),
        Panel("Finished requests by reason", "reqps", (
            (f"sum by (finished_reason) ({rate('tandem:request_success_total')})", "{{finished_reason}}"),
        ), "stop / length are normal ends; abort = client went away or stop string; error = engine failure."),
        Panel("Errors", "reqps", (
            ("sum by (engine) (" + rate("tandem:request_success_total", 'finished_reason="error"') + ")",
             "{{engine}} engine errors"),
            # Counted directly (not all - 2xx): when nothing succeeds there is no 2xx series to subtract.
            (f"sum(rate(tandem_router_requests_total{{status!~\"2..\"}}[{RI}])){ZERO}",
             "router non-2xx answers"),
            (f"sum by (engine) ({rate('tandem:request_rejected_total')})", "{{engine}} refused at admission"),
        ), "Requests that ended in an error: on the engines (finish_reason=error), refused by an engine at admission "
           "(503: overload, starting, draining, dead), and at the router (any non-2xx answer, after retries)."),
        Panel("Time to first token (p50 / p99)", "s", (
            (quantile(0.5, "tandem:time_to_first_token_seconds"), "{{engine}} p50"),
            (quantile(0.99, "tandem:time_to_first_token_seconds"), "{{engine}} p99"),
        ), "Arrival at the engine's HTTP front to the first token streamed back."),
        Panel("Inter-token latency (p50 / p99)", "s", (
            (quantile(0.5, "tandem:inter_token_latency_seconds"), "{{engine}} p50"),
            (quantile(0.99, "tandem:inter_token_latency_seconds"), "{{engine}} p99"),
        ), "One sample per token: an output of k tokens after dt counts k samples of dt/k, so MTP does not read as slow single tokens."),
        Panel("End-to-end latency (p50 / p99)", "s", (
            (quantile(0.5, "tandem:e2e_request_latency_seconds"), "{{engine}} p50"),
            (quantile(0.99, "tandem:e2e_request_latency_seconds"), "{{engine}} p99"),
        ), "Arrival to the last token."),
        Panel("Token throughput", "suffix: tok/s", (  # Grafana custom unit: a suffix after the value
            (f"sum by (engine) ({rate('tandem:prompt_tokens_total')})", "{{engine}} prompt"),
            (f"sum by (engine) ({rate('tandem:generation_tokens_total')})", "{{engine}} generation"),
        ), "Prompt tokens processed and tokens generated per second."),
        Panel("Running / waiting requests", "short", (
            (f"sum by (engine) (tandem:num_requests_running{{{SEL}}})", "{{engine}} running"),
            (f"sum by (engine) (tandem:num_requests_waiting{{{SEL}}})", "{{engine}} waiting"),
        ), "Requests in the running batch and in the scheduler's queue."),
        Panel("Queue time (p50 / p99)", "s", (
            (quantile(0.5, "tandem:request_queue_time_seconds"), "{{engine}} p50"),
            (quantile(0.99, "tandem:request_queue_time_seconds"), "{{engine}} p99"),
        ), "Time from arrival at the scheduler to the first schedule."),
    ]),
    ("KV cache", [
        Panel("KV cache usage", "percentunit", (
            (f"max by (engine) (tandem:kv_cache_usage_perc{{{SEL}}})", "{{engine}}"),
        ), "Share of the KV pool's pages in use (0-1)."),
        Panel("Prefix cache hit rate", "percentunit", (
            (f"sum by (engine) ({rate('tandem:prefix_cache_hits_total')}) / sum by (engine) ({rate('tandem:prefix_cache_queries_total')})",
             "{{engine}}"),
        ), "Prompt tokens found in the prefix cache / prompt tokens looked up."),
        Panel("Preemptions", "short", (
            (f"sum by (engine) ({rate('tandem:num_preemptions_total')})", "{{engine}}"),
        ), "Requests preempted (recomputed later) per second because the KV pool ran out of pages."),
    ]),
    ("Speculative decoding (frozen-KV MTP)", [
        Panel("Acceptance length", "short", (
            (f"1 + sum by (engine) ({rate('tandem:spec_decode_num_accepted_tokens_total')}) / sum by (engine) ({rate('tandem:spec_decode_num_drafts_total')})",
             "{{engine}}"),
        ), "Tokens per verify step, bonus token included (vLLM's definition: 1 + accepted / drafts)."),
        Panel("Draft acceptance rate", "percentunit", (
            (f"sum by (engine) ({rate('tandem:spec_decode_num_accepted_tokens_total')}) / sum by (engine) ({rate('tandem:spec_decode_num_draft_tokens_total')})",
             "{{engine}}"),
        ), "Accepted draft tokens / proposed draft tokens."),
        Panel("Per-position acceptance", "percentunit", (
            (f"sum by (position) ({rate('tandem:spec_decode_num_accepted_tokens_per_pos_total')}) / on() group_left() sum({rate('tandem:spec_decode_num_drafts_total')})",
             "position {{position}}"),
        ), "Share of draft rounds whose draft at this position was accepted (position 0 = first draft token)."),
    ]),
    ("Device and engine health", [
        Panel("GPU busy", "percentunit", (
            (f"sum by (engine) ({rate('tandem:gpu_busy_seconds_total')})", "{{engine}} busy"),
            (f"sum by (engine) ({rate('tandem:gpu_idle_between_steps_seconds_total')})", "{{engine}} idle between steps"),
        ), "Share of wall time the device ran engine steps, and the idle gaps between consecutive steps of continuing work (the process-boundary cost overlap hides)."),
        Panel("Engine restarts", "short", (
            (f"sum by (engine) (tandem:engine_restarts_total{{{SEL}}})", "{{engine}}"),
        ), "Worker/scheduler restarts by the supervisor (--restart-on-failure) since the engine started."),
        Panel("Scrape targets up", "short", (
            ('up{job=~"tandem-.*"}', "{{job}} {{instance}}"),
        ), "1 = Prometheus scraped the target's /metrics at the last attempt.",
            mappings=({"type": "value", "options": {"0": {"text": "down", "color": "red"},
                                                    "1": {"text": "up", "color": "green"}}},)),
    ]),
    ("Router", [
        Panel("Router requests by status", "reqps", (
            (f"sum by (status) (rate(tandem_router_requests_total[{RI}]))", "{{status}}"),
        ), "Answers of the router per HTTP status."),
        Panel("Router latency (p50 / p99)", "s", (
            (router_quantile(0.5, "tandem_router_request_duration_seconds"), "e2e p50"),
            (router_quantile(0.99, "tandem_router_request_duration_seconds"), "e2e p99"),
            (router_quantile(0.5, "tandem_router_ttft_seconds"), "TTFT p50"),
            (router_quantile(0.99, "tandem_router_ttft_seconds"), "TTFT p99"),
        ), "Arrival at the router to the first upstream byte (TTFT) and to the last byte sent."),
        Panel("Per-engine load (router view)", "short", (
            ("sum by (worker) (tandem_router_worker_load)", "{{worker}} load"),
            ("sum by (worker) (tandem_router_worker_requests_active)", "{{worker}} in flight"),
        ), "The load the router routes on (max of its in-flight count and the engine's running + waiting)."),
        Panel("Upstream attempts per engine", "reqps", (
            (f"sum by (worker, outcome) (rate(tandem_router_worker_requests_total[{RI}]))", "{{worker}} {{outcome}}"),
        ), "Attempts the router sent to each engine, by outcome."),
        Panel("Retries", "reqps", (
            (f"sum by (route) (rate(tandem_router_retries_total[{RI}])){ZERO}", "{{route}} retried"),
            (f"sum by (route) (rate(tandem_router_retries_exhausted_total[{RI}])){ZERO}", "{{route}} retries exhausted"),
        ), "Upstream attempts retried on another engine (only before the first byte reaches the client)."),
        Panel("Circuit breaker state", "short", (
            ("max by (worker) (tandem_router_worker_cb_state)", "{{worker}}"),
        ), "Per engine: 0 closed (serving), 1 open (cut off), 2 half-open (probing).",
            mappings=({"type": "value", "options": {"0": {"text": "closed", "color": "green"},
                                                    "1": {"text": "open", "color": "red"},
                                                    "2": {"text": "half-open", "color": "orange"}}},)),
        Panel("Engines in rotation", "short", (
            ("max by (worker) (tandem_router_worker_healthy)", "{{worker}}"),
        ), "1 = the router's health checks pass and it sends the engine traffic."),
    ]),
]


def _panel(p: Panel, pid: int, x: int, y: int) -> dict:
    return {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DS,
        "gridPos": {"h": 8, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": p.unit, "mappings": list(p.mappings),
                                     "custom": {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}},
                        "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend,
                     "range": True, "instant": False}
                    for i, (expr, legend) in enumerate(p.targets)],
        **p.extra,
    }


def _variable(name: str, label: str) -> dict:
    query = f"label_values(tandem:num_requests_running, {name})"
    return {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
        "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1,
    }


def build() -> dict:
    panels: list[dict] = []
    pid, y = 1, 0
    for row_title, row in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y, x = pid + 1, y + 1, 0
        for p in row:
            if x + p.width > 24:
                x, y = 0, y + 8
            panels.append(_panel(p, pid, x, y))
            pid, x = pid + 1, x + p.width
        y += 8
    return {
        "uid": "tandem-overview",
        "title": "Tandem",
        "description": "Tandem engines (tandem:* series) and router (tandem_router_*): latency, throughput, KV cache, speculative decoding, device busy, routing.",
        "tags": ["tandem", "llm", "serving"],
        "editable": False,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [_variable("engine", "Engine"), _variable("model_name", "Model")]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        with open(OUT) as f:
            stale = f.read() != text
        if stale:
            print(f"{OUT} is stale: run python deploy/grafana/make_dashboard.py", file=sys.stderr)
        return 1 if stale else 0
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
