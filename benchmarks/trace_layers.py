"""Per-layer view of a decode-step trace (``profile_step.py --trace``): the kernels of one
decoder layer, in order, with their mean duration and the mean gap before each (negative: the
kernel started before the previous one ended, as programmatic dependent launch allows).

A layer is found by its anchor kernel (one launch per layer; by default the one-row qkv GEMV
with RoPE + KV store, ``qkv_rope``, with the input norm before it, else the RoPE + KV-store
kernel with the norm and the qkv projection before it) and the most common distance between
consecutive anchors; only windows whose kernel names repeat that layout are averaged, so
prefill steps and the LM head stay out. With PDL a kernel's span includes its wait for the one
before, so the column to read is "adds": how much later it ends than its predecessor.

After the table: the device work *between steps* (from one step's last layer to the next
step's first: final norm, LM head, token selection, copies, the next step's input glue).

    python benchmarks/trace_layers.py trace_8b_bs1.json.gz [--anchor rope_store --before 2] [--json]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics


def load_kernels(path: str) -> list[dict]:
    """Device events (kernels, copies, memsets) of a Chrome trace, in start order."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = [e for e in trace.get("traceEvents", [])
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(events, key=lambda e: e["ts"])


def layer_table(events: list[dict], anchor: str, before: int = 2) -> dict:
    """Mean duration and gap per position of the layer layout (``before`` kernels ahead of the
    anchor belong to the layer: Llama's input norm and qkv)."""
    idx = [i for i, e in enumerate(events) if anchor in e["name"]]
    if len(idx) < 2:
        raise SystemExit(f"fewer than two {anchor!r} kernels in the trace")
    period = collections.Counter(b - a for a, b in zip(idx, idx[1:])).most_common(1)[0][0]
    layouts = collections.Counter()
    windows = []
    for i in idx:
        lo, hi = i - before, i - before + period
        if lo < 1 or hi > len(events):
            continue
        names = tuple(e["name"] for e in events[lo:hi])
        layouts[names] += 1
        windows.append((lo, names))
    layout, count = layouts.most_common(1)[0]
    rows = []
    for pos, name in enumerate(layout):
        durs, gaps = [], []
        for lo, names in windows:
            if names != layout:
                continue
            e, prev = events[lo + pos], events[lo + pos - 1]
            durs.append(e["dur"])
            gaps.append(e["ts"] - (prev["ts"] + prev["dur"]))
        rows.append(dict(pos=pos, name=name, dur_us=statistics.fmean(durs), gap_us=statistics.fmean(gaps),
                         min_gap_us=min(gaps), adds_us=statistics.fmean(durs) + statistics.fmean(gaps)))
    total = sum(r["dur_us"] + r["gap_us"] for r in rows)
    starts = [lo for lo, names in windows if names == layout]
    return dict(anchor=anchor, kernels_per_layer=period, layers_averaged=count, rows=rows, starts=starts,
                layer_us=total, kernel_us=sum(r["dur_us"] for r in rows), gap_us=sum(r["gap_us"] for r in rows))


def between_steps(events: list[dict], table: dict) -> dict | None:
    """The device work between one step's last layer and the next step's first (the LM head,
    token selection, copies, the next step's input glue): the most common such sequence, with
    each kernel's mean duration and the gap before it, and its whole span. None if the trace
    has fewer than two runs of layers."""
    period, starts = table["kernels_per_layer"], table["starts"]
    runs = [[starts[0]]]  # consecutive layers: one step's
    for lo in starts[1:]:
        if lo - runs[-1][-1] == period:
            runs[-1].append(lo)
        else:
            runs.append([lo])
    segments = [(a[-1] + period, b[0]) for a, b in zip(runs, runs[1:])]
    if not segments:
        return None
    layouts = collections.Counter(tuple(e["name"] for e in events[lo:hi]) for lo, hi in segments)
    layout, count = layouts.most_common(1)[0]
    same = [(lo, hi) for lo, hi in segments if tuple(e["name"] for e in events[lo:hi]) == layout]
    rows = []
    for pos, name in enumerate(layout):
        durs = [events[lo + pos]["dur"] for lo, _ in same]
        gaps = [events[lo + pos]["ts"] - (events[lo + pos - 1]["ts"] + events[lo + pos - 1]["dur"]) for lo, _ in same]
        rows.append(dict(name=name, dur_us=statistics.fmean(durs), gap_us=statistics.fmean(gaps)))
    spans = [events[hi]["ts"] - (events[lo - 1]["ts"] + events[lo - 1]["dur"]) for lo, hi in same]
    return dict(steps_averaged=count, rows=rows, span_us=statistics.fmean(spans),
                kernel_us=sum(r["dur_us"] for r in rows))


def default_anchor(events: list[dict]) -> tuple[str, int]:
    """(anchor, kernels before it): the fused one-row qkv + RoPE kernel after the input norm
    where the trace has one, else RoPE + KV store after the norm and the qkv projection."""
    if any("qkv_rope" in e["name"] for e in events):
        return "qkv_rope", 1
    return "rope_store", 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--anchor", help="a kernel name part launched once per layer (default: qkv_rope if "
                    "the trace has it, else rope_store)")
    ap.add_argument("--before", type=int, help="kernels of the layer ahead of the anchor (default 1 for "
                    "qkv_rope: the norm; 2 for rope_store: norm, qkv)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    events = load_kernels(args.trace)
    anchor, before = default_anchor(events)
    table = layer_table(events, args.anchor or anchor, before if args.before is None else args.before)
    steps = between_steps(events, table)
    if args.json:
        print(json.dumps(dict(table, between_steps=steps), indent=1))
        return
    print(f"{table['layers_averaged']} layers of {table['kernels_per_layer']} kernels: "
          f"{table['layer_us']:.2f} us a layer = {table['kernel_us']:.2f} in kernels + {table['gap_us']:.2f} between")
    print(f"{'kernel':44s} {'us':>8s} {'gap before':>11s} {'min gap':>8s} {'adds':>7s}")
    for r in table["rows"]:
        print(f"{r['name'][:44]:44s} {r['dur_us']:8.2f} {r['gap_us']:11.2f} {r['min_gap_us']:8.2f} {r['adds_us']:7.2f}")
    if steps is not None:
        print(f"between steps ({steps['steps_averaged']} averaged): {steps['span_us']:.2f} us from the last layer's "
              f"end to the next step's first layer, {steps['kernel_us']:.2f} in {len(steps['rows'])} device ops")
        for r in steps["rows"]:
            print(f"{r['name'][:44]:44s} {r['dur_us']:8.2f} {r['gap_us']:11.2f}")


if __name__ == "__main__":
    main()
