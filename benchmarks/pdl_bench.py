"""One Llama-3.1-8B decode layer's kernel chain at one row, inside a CUDA graph, with and without
programmatic dependent launch (PDL) and the fused act+down GEMV (``gpu_worker/kernels``).

Chain per layer (the engine's order, attention replaced by a same-sized norm so no KV pool is
needed): add+norm -> qkv GEMV -> norm(q) -> o GEMV -> add+norm -> gate_up GEMV -> act + down.
Eight layers of distinct weights (3.5 GB) so nothing is served from L2. Per variant: time per
layer (graph replays, median) against the weight bytes over the copy bandwidth, and a race
check: fresh random inputs copied into the graph's static buffers, replayed, compared bitwise
with the same kernels run eagerly without PDL.

    python benchmarks/pdl_bench.py [--json OUT] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hbm_bandwidth import copy_bandwidth  # noqa: E402
from gpu_worker.kernels import gemv as G  # noqa: E402
from gpu_worker.kernels.activation import gated_act  # noqa: E402
from gpu_worker.kernels.norm import MODE_ADD_NORM, MODE_NORM, launch_norm  # noqa: E402

H, I, QKV, Q = 4096, 14336, 6144, 4096
# (name, TANDEM_PDL, fused down, prefetch columns)
VARIANTS = [("base", "0", False, 0), ("pdl", "1", False, 1024), ("pdl+fused", "1", True, 1024),
            ("fused", "0", True, 0), ("pdl+fused, no prefetch", "1", True, 0),
            ("pdl+fused, prefetch 2048", "1", True, 2048), ("pdl+fused, prefetch 512", "1", True, 512)]


def make_layers(n: int) -> list[dict]:
    def w(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02
    return [dict(n1=1 + w(H), qkv=w(QKV, H), nq=1 + w(H), o=w(H, Q), n2=1 + w(H), gu=w(2 * I, H), down=w(H, I))
            for _ in range(n)]


def chain(layers, x, r, fused: bool):
    """Returns the last layer's output; ``r`` (the residual stream) is updated in place."""
    for L in layers:
        h = launch_norm(MODE_ADD_NORM, x, r, L["n1"], None, None, 1e-5, gemma=False)
        qkv = G.gemv(h, L["qkv"], **G.CONFIG)
        a = launch_norm(MODE_NORM, qkv[:, :Q], None, L["nq"], None, None, 1e-5, gemma=False)  # attention's slot
        x = G.gemv(a, L["o"], **G.CONFIG)
        h = launch_norm(MODE_ADD_NORM, x, r, L["n2"], None, None, 1e-5, gemma=False)
        gu = G.gemv(h, L["gu"], **G.CONFIG)
        if fused:
            x = G.gemv(gu, L["down"], act="silu", **G.CONFIG)
        else:
            x = F.linear(gated_act(gu[:, :I], gu[:, I:], "silu"), L["down"])
    return x


def run_variant(layers, name: str, pdl: str, fused: bool, prefetch: int, checks: int) -> dict:
    os.environ["TANDEM_PDL"] = pdl
    G.PREFETCH_K = prefetch
    x0 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    r0 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    xs, rs = x0.clone(), r0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            chain(layers, xs.clone(), rs.clone(), fused)  # compile every variant first
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(layers, xs, rs, fused)
    # race check: fresh inputs, replay, compare with the same kernels eagerly and without PDL
    mismatches = 0
    for i in range(checks):
        x1 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
        r1 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
        xs.copy_(x1)
        rs.copy_(r1)
        graph.replay()
        got = out.clone()
        os.environ["TANDEM_PDL"] = "0"
        ref = chain(layers, x1.clone(), r1.clone(), fused)
        os.environ["TANDEM_PDL"] = pdl
        mismatches += int(not torch.equal(got, ref))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(15):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 10)
    times.sort()
    ms = times[len(times) // 2]
    return dict(name=name, pdl=pdl, fused=fused, prefetch=prefetch, ms_per_chain=ms, race_mismatches=mismatches,
                checks=checks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--checks", type=int, default=5)
    args = ap.parse_args()
    bw = copy_bandwidth()
    layers = make_layers(args.layers)
    layer_bytes = sum(t.numel() * t.element_size() for t in layers[0].values())
    floor_us = layer_bytes / bw * 1e6
    rows = []
    for name, pdl, fused, pre in VARIANTS:
        try:
            row = run_variant(layers, name, pdl, fused, pre, args.checks)
        except Exception as exc:  # a variant that cannot capture is a finding, not the end of the run
            row = dict(name=name, error=repr(exc))
        if "ms_per_chain" in row:
            row["us_per_layer"] = row["ms_per_chain"] * 1e3 / args.layers
            row["of_floor"] = floor_us / row["us_per_layer"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nper layer: {layer_bytes / 1e6:.1f} MB of weights, floor {floor_us:.1f} us at {bw / 1e12:.2f} TB/s")
    print(f"{'variant':28s} {'us/layer':>9s} {'% floor':>8s} {'races':>6s}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:28s} ERROR {r['error'][:80]}")
        else:
            print(f"{r['name']:28s} {r['us_per_layer']:9.1f} {100 * r['of_floor']:7.1f}% "
                  f"{r['race_mismatches']}/{r['checks']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(bandwidth=bw, layer_bytes=layer_bytes, floor_us=floor_us, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
