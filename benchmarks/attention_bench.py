"""Paged decode attention alone: triton vs flashinfer vs torch, as bandwidth.

One Llama-3.1-8B attention layer (32 query heads, 8 KV heads, head dim 128, bf16, page 16) at
contexts 2k and 8k, 1 and 64 rows, pages shuffled. Bytes = the K and V each row reads (+ q and
out); GB/s is that over the median time (``triton.testing.do_bench``), beside the copy ceiling.

    python benchmarks/attention_bench.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hbm_bandwidth import copy_bandwidth  # noqa: E402
from gpu_worker.attention import create_backend, flashinfer_available  # noqa: E402
from gpu_worker.attention.base import RowLayout  # noqa: E402
from gpu_worker.forward_batch import AttnLayer, ForwardBatch  # noqa: E402
from gpu_worker.kv_pool import KVLayerShape, KVPool  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16


def setup(bs: int, ctx: int):
    pages_per = ctx // PS
    n_pages = bs * pages_per + 1
    pool = KVPool([KVLayerShape(HKV, D)], n_pages, PS, torch.bfloat16, "cuda")
    pool.k[0].normal_()
    pool.v[0].normal_()
    perm = np.random.default_rng(0).permutation(np.arange(1, n_pages)).reshape(bs, pages_per)
    pt = torch.zeros(bs + 1, pages_per, dtype=torch.int32, device="cuda")
    pt[1:] = torch.from_numpy(perm.astype(np.int32)).cuda()
    slots = torch.arange(1, bs + 1, device="cuda")
    kv = torch.full((bs,), ctx, dtype=torch.int64, device="cuda")
    layout = RowLayout(slots=slots, q_lens=np.ones(bs, np.int64), kv_lens=kv, kv_bound=np.full(bs, ctx),
                       q_pos=kv - 1)
    q = torch.randn(bs, HQ, D, dtype=torch.bfloat16, device="cuda")
    return pool, pt, layout, q


def bench_backend(name: str, bs: int, ctx: int) -> float:
    from triton.testing import do_bench

    pool, pt, layout, q = setup(bs, ctx)
    backend = create_backend(name, pool=pool, page_table=pt)
    layer = AttnLayer(kv_layer=0, sliding_window=None, scaling=D**-0.5, writes_kv=False)
    meta = backend.build(layout, ())
    fb = ForwardBatch(None, layout.q_pos, None, meta, bs)
    backend.forward(layer, q, None, None, fb)
    return do_bench(lambda: backend.forward(layer, q, None, None, fb), warmup=25, rep=100, return_mode="median") / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    bw = copy_bandwidth()
    backends = ["triton", "torch"] + (["flashinfer"] if flashinfer_available() else [])
    rows = []
    for ctx in (2048, 8192):
        for bs in (1, 64):
            nbytes = bs * ctx * HKV * D * 2 * 2 + 2 * bs * HQ * D * 2
            for name in backends:
                try:
                    sec = bench_backend(name, bs, ctx)
                except Exception as exc:  # noqa: BLE001 - report, keep going
                    rows.append({"backend": name, "ctx": ctx, "bs": bs, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                rows.append({"backend": name, "ctx": ctx, "bs": bs, "us": sec * 1e6, "gb_s": nbytes / sec / 1e9,
                             "frac_of_copy_bw": nbytes / sec / bw})
                torch.cuda.empty_cache()
    out = {"copy_bandwidth_bytes_s": bw, "rows": rows}
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
