"""The router's /metrics with --engine-metrics carries every healthy engine's series labelled
engine="host:port" (one HELP/TYPE per name), and /workers drops a start-up error once the
worker is healthy."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.federate import merge
from tests.helpers.fake_upstream import Stack, until


def test_engine_series_are_federated_with_an_engine_label():
    s = Stack(2, "--engine-metrics")
    try:
        s.fakes[0].running, s.fakes[1].running = 3, 5
        until(lambda: all(w.healthy for w in s.router.registry.all()))
        text = httpx.get(s.url + "/metrics").text
        assert text.count("# TYPE vllm:num_requests_running gauge") == 1
        running = {smp.labels["engine"]: smp.value for fam in text_string_to_metric_families(text)
                   if fam.name == "vllm:num_requests_running" for smp in fam.samples}
        hosts = [u.url.split("//")[1] for u in s.ups]
        assert running == {hosts[0]: 3.0, hosts[1]: 5.0}
        assert "tandem_router_requests_total" in text  # the router's own series stay
        s.fakes[1].healthy = False  # out of rotation: out of the scrape too
        until(lambda: not s.router.registry.all()[1].healthy)
        text = httpx.get(s.url + "/metrics").text
        assert f'engine="{hosts[1]}"' not in text and f'engine="{hosts[0]}"' in text
    finally:
        s.stop()


def test_without_the_flag_only_router_series():
    s = Stack(1)
    try:
        until(lambda: s.router.registry.all()[0].healthy)
        assert "vllm:num_requests_running" not in httpx.get(s.url + "/metrics").text
    finally:
        s.stop()


def test_merge_keeps_histograms_and_counters_whole():
    one = ('# HELP tandem:e2e d\n# TYPE tandem:e2e histogram\ntandem:e2e_bucket{le="1.0"} 2.0\n'
           'tandem:e2e_bucket{le="+Inf"} 3.0\ntandem:e2e_count 3.0\ntandem:e2e_sum 4.5\n'
           '# HELP tandem:req_total d\n# TYPE tandem:req_total counter\ntandem:req_total{model_name="m"} 7.0\n')
    text = merge({"a:1": one, "b:2": one}).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["tandem:e2e"].type == "histogram" and len(fams["tandem:e2e"].samples) == 8
    assert {(smp.labels["engine"], smp.value) for smp in fams["tandem:req"].samples} == {("a:1", 7.0), ("b:2", 7.0)}
    assert text.count("# TYPE tandem:req_total counter") == 1


def test_a_recovered_worker_shows_no_stale_error():
    s = Stack(1)
    try:
        s.fakes[0].healthy = False  # still starting: its first checks fail
        until(lambda: s.router.registry.all()[0].last_error)
        s.fakes[0].healthy = True
        until(lambda: s.router.registry.all()[0].healthy)
        (w,) = httpx.get(s.url + "/workers").json()["workers"]
        assert w["is_healthy"] and w["last_error"] is None
    finally:
        s.stop()
