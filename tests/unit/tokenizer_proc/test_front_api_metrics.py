"""Metrics semantics (per-token ITL, counter deltas, buckets), streaming usage, import boundary."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto.messages import ReqTimings, SchedulerStats
from tests.helpers.server import post_then_leave
from tests.unit.front_harness import start_stack
from tokenizer_proc.metrics import Metrics, buckets_1_2_5


def samples(m: Metrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: Metrics, name: str, **labels) -> float:
    labels = {"model_name": "m", **labels}
    return samples(m)[(name, tuple(sorted(labels.items())))]


def test_itl_is_recorded_per_token():
    m = Metrics("m")
    m.on_tokens(1, None, ttft=0.05)
    m.on_tokens(3, 0.3, None)  # one step carrying 3 tokens after 300 ms: 3 samples of 100 ms
    assert value(m, "tandem:inter_token_latency_seconds_count") == 3
    assert value(m, "tandem:inter_token_latency_seconds_sum") == pytest.approx(0.3)
    assert value(m, "tandem:inter_token_latency_seconds_bucket", le="0.1") == 3
    assert value(m, "tandem:time_to_first_token_seconds_count") == 1
    assert value(m, "tandem:generation_tokens_total") == 4


def test_counters_follow_cumulative_stats():
    m = Metrics("m")
    m.on_stats(SchedulerStats(2, 1, 30, 100, prefix_queries=10, prefix_hits=4, spec_num_drafts=5,
                              spec_num_draft_tokens=15, spec_num_accepted_tokens=9, spec_accepted_per_pos=(5, 3, 1)))
    m.on_stats(SchedulerStats(1, 0, 10, 100, prefix_queries=25, prefix_hits=4, spec_num_drafts=6,
                              spec_num_draft_tokens=18, spec_num_accepted_tokens=11, spec_accepted_per_pos=(6, 4, 1)))
    assert value(m, "tandem:num_requests_running") == 1 and value(m, "tandem:num_requests_waiting") == 0
    assert value(m, "tandem:kv_cache_usage_perc") == pytest.approx(0.1)
    assert value(m, "tandem:prefix_cache_queries_total") == 25
    assert value(m, "tandem:spec_decode_num_accepted_tokens_total") == 11
    assert value(m, "tandem:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 4
    # A restarted engine reports small cumulative values again: they count as new increments.
    m.on_stats(SchedulerStats(0, 0, 0, 100, prefix_queries=3))
    assert value(m, "tandem:prefix_cache_queries_total") == 28


def test_finish_records_request_histograms():
    m = Metrics("m", compat="vllm")
    m.set_max_model_len(1000)
    m.on_finish("stop", 12, 5, e2e=1.0, ttft=0.2, timings=ReqTimings(0.1, 0.1, 0.8))
    assert value(m, "tandem:request_success_total", finished_reason="stop") == 1
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(m, "tandem:request_time_per_output_token_seconds_sum") == pytest.approx(0.2)
    assert value(m, "tandem:request_decode_time_seconds_sum") == pytest.approx(0.8)
    assert value(m, "tandem:request_prompt_tokens_bucket", le="20.0") == 1
    assert value(m, "tandem:prompt_tokens_total") == 12
    assert buckets_1_2_5(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_end_to_end_success_and_abort_counts():
    stack = start_stack()
    try:
        with httpx.Client(base_url=stack.base_url, timeout=10) as c:
            c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
            stack.fake.paused = True
            post_then_leave(stack.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 5},
                            until=lambda: stack.engine.num_inflight == 1)  # accepted, then the client leaves
            assert stack.fake.wait_for(lambda: stack.engine.num_inflight == 0)
            stack.fake.paused = False
            text = c.get("/metrics").text
        assert 'tandem:request_success_total{finished_reason="length",model_name="fake-model"} 1.0' in text
        assert 'tandem:request_success_total{finished_reason="abort",model_name="fake-model"} 1.0' in text
        assert 'tandem:generation_tokens_total{model_name="fake-model"} 3.0' in text  # the warm-up is not counted
    finally:
        stack.close()


def test_continuous_usage_stats():
    """vLLM: usage on every chunk only with include_usage *and* continuous_usage_stats;
    continuous_usage_stats alone sends no usage at all (no per-chunk usage, no usage chunk)."""
    stack = start_stack()
    try:
        with httpx.Client(base_url=stack.base_url, timeout=10) as c:
            def chunks(options: dict) -> list[dict]:
                r = c.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 4, "stream": True,
                                                    "stream_options": options})
                return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]

            both = chunks({"include_usage": True, "continuous_usage_stats": True})
            alone = chunks({"continuous_usage_stats": True})
            final_only = chunks({"include_usage": True, "continuous_usage_stats": False})
        counts = [ch["usage"]["completion_tokens"] for ch in both]
        assert counts == sorted(counts) and counts[-1] == 4 and both[-1]["choices"] == []
        assert all(ch["usage"]["total_tokens"] == ch["usage"]["prompt_tokens"] + ch["usage"]["completion_tokens"]
                   for ch in both)
        assert alone and all("usage" not in ch for ch in alone) and all(ch["choices"] for ch in alone)
        assert all("usage" not in ch for ch in final_only[:-1]) and final_only[-1]["usage"]["completion_tokens"] == 4
    finally:
        stack.close()


def test_tokenizer_proc_never_imports_torch_or_other_processes():
    code = (
        "import sys, tokenizer_proc.main, tokenizer_proc.app\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'scheduler_proc', 'gpu_worker', 'router', 'tandem')]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
