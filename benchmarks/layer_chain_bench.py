"""One Llama-3.1-8B (or Gemma-4-9B-shaped, ``--shape``) decode layer's kernel chain at one row,
inside a CUDA graph, as the engine's dispatch runs it (``kernels/gemv.py: linear,
gated_linear``) under each variant's environment: the MLP as gate_up GEMV + activation kernel
+ cuBLAS split-K down (the chain before 2026-12-03),
the gated GEMV (activation in its epilogue; 4 or 8 rows of gate and of up per program), its
split-K down at 2 / 4 / 8 splits, split K on the shorter projections too, and the defaults
without programmatic dependent launch (PDL, on by default at one row since 2026-12-04).

Chain per layer (the engine's order, attention replaced by a same-sized norm so no KV pool is
needed): add+norm -> qkv -> norm(q) -> o -> add+norm -> MLP. Eight layers of distinct weights
(3.5 GB) so nothing is served from L2. Per variant: time per layer (graph replays, median)
against the weight bytes over the copy bandwidth, and a race check: fresh random inputs copied
into the graph's static buffers, replayed, compared bitwise with the same kernels run eagerly
without PDL (split-K's tickets or a PDL read before the wait would show as a moving error).

    python benchmarks/layer_chain_bench.py [--json OUT] [--layers 8] [--shape llama-8b|gemma4-9b]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hbm_bandwidth import copy_bandwidth  # noqa: E402
from gpu_worker.kernels import gemv as G  # noqa: E402
from gpu_worker.kernels.activation import gated_act  # noqa: E402
from gpu_worker.kernels.norm import MODE_ADD_NORM, MODE_NORM, launch_norm  # noqa: E402

# (hidden, intermediate, qkv rows, q rows, activation) of each model's sliding / plain layer
SHAPES = {"llama-8b": (4096, 14336, 6144, 4096, "silu"),
          "gemma4-9b": (3840, 15360, 8192, 4096, "gelu_pytorch_tanh")}
H, I, QKV, Q, ACT = SHAPES["llama-8b"]
ENV_KEYS = ("TANDEM_PDL", "TANDEM_GATED_GEMV", "TANDEM_GEMV_SPLITK", "TANDEM_GEMV_SPLITK_SHORT",
            "TANDEM_GATED_BLOCK_N")
VARIANTS = [
    ("before: act kernel + cuBLAS down", dict(TANDEM_GATED_GEMV="0", TANDEM_GEMV_SPLITK="0")),
    ("act kernel, split-K down 4 (default)", dict()),
    ("act kernel, split-K down 2", dict(TANDEM_GEMV_SPLITK="2")),
    ("act kernel, split-K down 8", dict(TANDEM_GEMV_SPLITK="8")),
    ("gated 2x4 rows, cuBLAS down", dict(TANDEM_GATED_GEMV="1", TANDEM_GEMV_SPLITK="0")),
    ("gated 2x8 rows, cuBLAS down", dict(TANDEM_GATED_GEMV="1", TANDEM_GEMV_SPLITK="0", TANDEM_GATED_BLOCK_N="8")),
    ("gated 2x4, split-K down 4", dict(TANDEM_GATED_GEMV="1")),
    ("default, K<=8192 split 2", dict(TANDEM_GEMV_SPLITK_SHORT="2")),
    ("default without PDL", dict(TANDEM_PDL="0")),
]


def set_env(env: dict) -> None:
    for key in ENV_KEYS:
        os.environ.pop(key, None)
    os.environ.update(env)


def make_layers(n: int) -> list[dict]:
    def w(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02
    return [dict(n1=1 + w(H), qkv=w(QKV, H), nq=1 + w(Q), o=w(H, Q), n2=1 + w(H), gu=w(2 * I, H), down=w(H, I))
            for _ in range(n)]


def mlp(h, gu_w, down_w):
    """GatedMLP.forward at TP=1."""
    a = G.gated_linear(h, gu_w, ACT)
    if a is None:
        gu = G.linear(h, gu_w)
        a = gated_act(gu[:, :I], gu[:, I:], ACT)
    return G.linear(a, down_w)


def chain(layers, x, r):
    """Returns the last layer's output; ``r`` (the residual stream) is updated in place."""
    for L in layers:
        h = launch_norm(MODE_ADD_NORM, x, r, L["n1"], None, None, 1e-5, gemma=False)
        qkv = G.linear(h, L["qkv"])
        a = launch_norm(MODE_NORM, qkv[:, :Q], None, L["nq"], None, None, 1e-5, gemma=False)  # attention's slot
        x = G.linear(a, L["o"])
        h = launch_norm(MODE_ADD_NORM, x, r, L["n2"], None, None, 1e-5, gemma=False)
        x = mlp(h, L["gu"], L["down"])
    return x


def run_variant(layers, name: str, env: dict, checks: int) -> dict:
    set_env(env)
    x0 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    r0 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    xs, rs = x0.clone(), r0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            chain(layers, xs.clone(), rs.clone())  # compile every variant first
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(layers, xs, rs)
    mismatches = 0
    for _ in range(checks):
        x1 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
        r1 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
        xs.copy_(x1)
        rs.copy_(r1)
        graph.replay()
        got = out.clone()
        set_env(env | {"TANDEM_PDL": "0"})
        ref = chain(layers, x1.clone(), r1.clone())
        set_env(env)
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
    return dict(name=name, env=env, ms_per_chain=times[len(times) // 2], race_mismatches=mismatches, checks=checks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--checks", type=int, default=5)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    args = ap.parse_args()
    global H, I, QKV, Q, ACT
    H, I, QKV, Q, ACT = SHAPES[args.shape]
    bw = copy_bandwidth()
    layers = make_layers(args.layers)
    layer_bytes = sum(t.numel() * t.element_size() for t in layers[0].values())
    floor_us = layer_bytes / bw * 1e6
    rows = []
    for name, env in VARIANTS:
        try:
            row = run_variant(layers, name, env, args.checks)
        except Exception as exc:  # a variant that cannot capture is a finding, not the end of the run
            row = dict(name=name, env=env, error=repr(exc))
        if "ms_per_chain" in row:
            row["us_per_layer"] = row["ms_per_chain"] * 1e3 / args.layers
            row["of_floor"] = floor_us / row["us_per_layer"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    set_env({})
    print(f"\n{args.shape} per layer: {layer_bytes / 1e6:.1f} MB of weights, floor {floor_us:.1f} us at {bw / 1e12:.2f} TB/s")
    print(f"{'variant':34s} {'us/layer':>9s} {'% floor':>8s} {'races':>6s}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:34s} ERROR {r['error'][:80]}")
        else:
            print(f"{r['name']:34s} {r['us_per_layer']:9.1f} {100 * r['of_floor']:7.1f}% "
                  f"{r['race_mismatches']}/{r['checks']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=args.shape, bandwidth=bw, layer_bytes=layer_bytes, floor_us=floor_us, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
