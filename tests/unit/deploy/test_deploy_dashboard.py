"""deploy/grafana's dashboard read as Grafana and Prometheus would: its structure, the topics it
covers, every series it names exists in the code, and promtool evaluates the router panels'
PromQL. The rest of deploy/ is in test_deploy_files.py."""

from __future__ import annotations

import json
import os
import re
import sys

import yaml

from tests.helpers.deploy_stack import DEPLOY, find_tool, run_tool

PROM_DIR = os.path.join(DEPLOY, "prometheus")
GRAFANA_DIR = os.path.join(DEPLOY, "grafana")
DASHBOARD = os.path.join(GRAFANA_DIR, "dashboards", "tandem.json")


def _dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def _exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])]


def test_generated_files_are_up_to_date():
    for script in ("grafana/make_dashboard.py", "k8s/make_prometheusrule.py"):
        out = run_tool([sys.executable, os.path.join(DEPLOY, script), "--check"])
        assert out.returncode == 0, out.stderr


def test_dashboard_structure():
    dash = _dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    with open(os.path.join(GRAFANA_DIR, "provisioning", "datasources", "prometheus.yml")) as f:
        uid = yaml.safe_load(f)["datasources"][0]["uid"]
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == uid and p["datasource"]["uid"] == uid
    for var in dash["templating"]["list"]:
        assert var["datasource"]["uid"] == uid


# Every topic of the issue, and the series that shows it.
REQUIRED = {
    "request rate": "tandem:request_success_total", "errors": 'finished_reason="error"',
    "TTFT": "tandem:time_to_first_token_seconds_bucket", "ITL": "tandem:inter_token_latency_seconds_bucket",
    "e2e": "tandem:e2e_request_latency_seconds_bucket", "prompt tok/s": "tandem:prompt_tokens_total",
    "generation tok/s": "tandem:generation_tokens_total", "running": "tandem:num_requests_running",
    "waiting": "tandem:num_requests_waiting", "KV usage": "tandem:kv_cache_usage_perc",
    "prefix hit rate": "tandem:prefix_cache_hits_total", "spec accept length": "tandem:spec_decode_num_drafts_total",
    "per-position": "tandem:spec_decode_num_accepted_tokens_per_pos_total", "GPU busy": "tandem:gpu_busy_seconds_total",
    "preemptions": "tandem:num_preemptions_total", "restarts": "tandem:engine_restarts_total",
    "router load": "tandem_router_worker_load", "retries": "tandem_router_retries_total",
    "circuit": "tandem_router_worker_cb_state",
}


def test_dashboard_covers_every_topic():
    text = "\n".join(_exprs())
    missing = [topic for topic, needle in REQUIRED.items() if needle not in text]
    assert not missing
    assert text.count("histogram_quantile(0.5,") >= 4 and text.count("histogram_quantile(0.99,") >= 4


def _family_names(registry) -> set[str]:
    names = set()
    for fam in registry.collect():
        for s in fam.samples:
            names.add(s.name)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(fam.type, ("",))
        names.update(fam.name + sfx for sfx in suffixes)
    return names


def test_every_series_named_in_deploy_exists_in_the_code():
    """Names in the dashboard and the alert rules are the ones the engine and router export."""
    from router.metrics import RouterMetrics
    from tokenizer_proc.metrics import Metrics

    m = Metrics("m")
    m.set_max_model_len(128)
    engine = _family_names(m.registry)
    router = _family_names(RouterMetrics(lambda: [], tree_size=lambda _: 0, decisions=dict).registry)
    with open(os.path.join(PROM_DIR, "alerts.yml")) as f:
        rules = [r["expr"] for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    used = set(re.findall(r"\b(tandem:[a-z0-9_]+|tandem_router_[a-z0-9_]+)", "\n".join(_exprs() + rules)))
    unknown = sorted(n for n in used if n not in engine | router)
    assert not unknown, f"series the code does not export: {unknown}"


def _panel_expr(title: str, ref: str) -> str:
    """A dashboard query as Grafana sends it for "All", with a 20 s $__rate_interval (5 s scrapes)."""
    (expr,) = [t["expr"] for p in _dashboard()["panels"] if p["title"] == title
               for t in p.get("targets", []) if t["refId"] == ref]
    return expr.replace("$__rate_interval", "20s").replace("$engine", ".*").replace("$model_name", ".*")


def test_router_panels_show_values_before_and_when_nothing_succeeds(tmp_path):
    """promtool evaluates the panels' PromQL on synthetic series: the router's error line has a
    value while every answer is a 503 (no 2xx series exists then), and the retry panels read 0,
    not "No data", before the router's first retry creates their counters."""
    promtool = find_tool("promtool")
    router_down = ['tandem_router_requests_total{route="/v1/completions",status="503"}', "0+10x20"]
    healthy = ['tandem_router_requests_total{route="/v1/completions",status="200"}', "0+10x20"]
    cases = [
        (router_down, ("Errors", "B"), 2),  # 10 answers per 5 s scrape = 2/s, every one a 503
        (healthy, ("Errors", "B"), 0),
        (healthy, ("Retries", "A"), 0),
        (healthy, ("Retries", "B"), 0),
    ]
    tests = [{"interval": "5s", "input_series": [{"series": s, "values": v}],
              "promql_expr_test": [{"expr": _panel_expr(*panel), "eval_time": "1m",
                                    "exp_samples": [{"labels": "{}", "value": want}]}]}
             for (s, v), panel, want in cases]
    path = tmp_path / "panels_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "5s", "tests": tests}))
    out = run_tool([promtool, "test", "rules", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
