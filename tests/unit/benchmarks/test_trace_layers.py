"""benchmarks/trace_layers.py: the per-layer table of a decode trace, on a synthetic trace."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.trace_layers import between_steps, default_anchor, layer_table, load_kernels

LAYER = [("norm", 2.0), ("qkv", 14.0), ("rope_store", 2.0), ("attn", 6.0), ("o", 12.0)]


def _trace(path, layers: int, gap: float, overlap_at: str | None = None):
    events, t = [], 0.0
    events.append(dict(ph="X", cat="kernel", name="prefill_gemm", ts=t, dur=100.0))  # not a layer
    t += 100.0 + gap
    for _ in range(layers):
        for name, dur in LAYER:
            start = t - 1.0 if name == overlap_at else t  # PDL: starts before the previous ends
            events.append(dict(ph="X", cat="kernel", name=name, ts=start, dur=dur))
            t = start + dur + gap
    events.append(dict(ph="X", cat="cpu_op", name="aten::mm", ts=0.0, dur=1.0))  # host events ignored
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_layer_table_averages_the_repeating_layout(tmp_path):
    table = layer_table(load_kernels(_trace(tmp_path / "t.json.gz", layers=6, gap=0.5)), "rope_store")
    assert table["kernels_per_layer"] == len(LAYER)
    assert [r["name"] for r in table["rows"]] == [n for n, _ in LAYER]
    assert [r["dur_us"] for r in table["rows"]] == pytest.approx([d for _, d in LAYER])
    assert table["gap_us"] == pytest.approx(0.5 * len(LAYER))
    assert table["layer_us"] == pytest.approx(sum(d for _, d in LAYER) + 0.5 * len(LAYER))


def test_overlap_shows_as_a_negative_gap(tmp_path):
    table = layer_table(load_kernels(_trace(tmp_path / "t.json.gz", layers=4, gap=0.5, overlap_at="qkv")),
                        "rope_store")
    gaps = {r["name"]: r["gap_us"] for r in table["rows"]}
    assert gaps["qkv"] == pytest.approx(-0.5) and gaps["attn"] == pytest.approx(0.5)


def test_no_anchor_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="rope_store"):
        layer_table(load_kernels(_trace(tmp_path / "t.json.gz", layers=1, gap=0.5)), "rope_store")


def test_pdl_overlap_adds_and_the_default_anchor(tmp_path):
    """Under PDL a kernel's span includes its wait: "adds" (how much later it ends than the one
    before) is what it costs the layer, and the layer's adds sum to its time. A trace with the
    fused one-row qkv + RoPE kernel is anchored there (rope_store runs only in prefill steps)."""
    events = load_kernels(_trace(tmp_path / "t.json.gz", layers=4, gap=0.5, overlap_at="attn"))
    table = layer_table(events, *default_anchor(events))
    adds = {r["name"]: r["adds_us"] for r in table["rows"]}
    assert adds["attn"] == pytest.approx(6.0 - 0.5) and adds["o"] == pytest.approx(12.5)
    assert sum(adds.values()) == pytest.approx(table["layer_us"])
    fused = [dict(e, name="_qkv_rope_kernel") if e["name"] == "qkv" else e for e in events]
    assert default_anchor(fused) == ("qkv_rope", 1) and default_anchor(events) == ("rope_store", 2)


def test_between_steps_is_the_work_outside_the_layers(tmp_path):
    """Three decode steps of 3 layers each, separated by an LM head, a copy and a glue kernel:
    ``between_steps`` reports that sequence (mean durations, gaps) and its span."""
    events, t = [], 0.0
    tail = [("lm_head", 40.0, "kernel"), ("Memcpy DtoH", 1.5, "gpu_memcpy"), ("glue", 2.0, "kernel")]
    for step in range(3):
        for _ in range(3):
            for name, dur in LAYER:
                events.append(dict(ph="X", cat="kernel", name=name, ts=t, dur=dur))
                t += dur + 0.5
        if step < 2:
            for name, dur, cat in tail:
                t += 3.0  # a wider gap outside the layers
                events.append(dict(ph="X", cat=cat, name=name, ts=t, dur=dur))
                t += dur
            t += 1.0
    path = tmp_path / "s.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    events = load_kernels(str(path))
    steps = between_steps(events, layer_table(events, "rope_store"))
    assert steps["steps_averaged"] == 2
    assert [r["name"] for r in steps["rows"]] == [n for n, _, _ in tail]
    assert [r["dur_us"] for r in steps["rows"]] == pytest.approx([d for _, d, _ in tail])
    assert [r["gap_us"] for r in steps["rows"]] == pytest.approx([3.5, 3.0, 3.0])
    assert steps["span_us"] == pytest.approx(0.5 + 3 * 3.0 + 43.5 + 1.0)
