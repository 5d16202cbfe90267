"""Paged decode attention alone: triton vs flashinfer vs torch, as bandwidth.

One attention layer, bf16, page 16, pages shuffled: Llama-3.1-8B's (32 query heads, 8 KV heads,
head dim 128) at contexts 2k and 8k, 1 and 64 rows, and Qwen3-0.6B's (16 / 8 heads) at 256 rows
of 512 and 1k, the nano-vllm workload's regime. Bytes = the K and V each row reads (+ q and
out); GB/s is that over the median time (``triton.testing.do_bench``), beside the copy ceiling.
``flashinfer-kernel`` is FlashInfer's paged decode kernel called directly (a peer, measured
side by side; JIT-compiled on first use) whether or not our flashinfer backend is built.

    python benchmarks/attention_bench.py [--json OUT]
"""

from __future__ import annotations

import argparse
import importlib.util
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

D, PS = 128, 16
SHAPES = [("llama-8b", 32, 8, ctx, bs) for ctx in (2048, 8192) for bs in (1, 64)] + \
    [("qwen3-0.6b", 16, 8, ctx, 256) for ctx in (512, 1024)]


def setup(bs: int, ctx: int, hq: int, hkv: int, shuffle: bool = True, d: int = D):
    """One KV layer of ``bs`` rows of ``ctx`` keys of head dim ``d`` (pages shuffled, or in
    order) + one query per row."""
    pages_per = -(-ctx // PS)
    n_pages = bs * pages_per + 1
    pool = KVPool([KVLayerShape(hkv, d)], n_pages, PS, torch.bfloat16, "cuda")
    pool.k[0].normal_()
    pool.v[0].normal_()
    ids = np.arange(1, n_pages)
    perm = (np.random.default_rng(0).permutation(ids) if shuffle else ids).reshape(bs, pages_per)
    pt = torch.zeros(bs + 1, pages_per, dtype=torch.int32, device="cuda")
    pt[1:] = torch.from_numpy(perm.astype(np.int32)).cuda()
    slots = torch.arange(1, bs + 1, device="cuda")
    kv = torch.full((bs,), ctx, dtype=torch.int64, device="cuda")
    layout = RowLayout(slots=slots, q_lens=np.ones(bs, np.int64), kv_lens=kv, kv_bound=np.full(bs, ctx),
                       q_pos=kv - 1)
    q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device="cuda")
    return pool, pt, layout, q


def bench_backend(name: str, bs: int, ctx: int, hq: int, hkv: int) -> float:
    from triton.testing import do_bench

    if name == "flashinfer-kernel":
        return bench_flashinfer_kernel(bs, ctx, hq, hkv)
    pool, pt, layout, q = setup(bs, ctx, hq, hkv)
    backend = create_backend(name, pool=pool, page_table=pt)
    layer = AttnLayer(kv_layer=0, sliding_window=None, scaling=D**-0.5, writes_kv=False)
    meta = backend.build(layout, ())
    fb = ForwardBatch(None, layout.q_pos, None, meta, bs)
    backend.forward(layer, q, None, None, fb)
    return do_bench(lambda: backend.forward(layer, q, None, None, fb), warmup=25, rep=100, return_mode="median") / 1e3


def bench_flashinfer_kernel(bs: int, ctx: int, hq: int, hkv: int) -> float:
    import flashinfer
    from triton.testing import do_bench

    pool, pt, layout, q = setup(bs, ctx, hq, hkv)
    pages_per = ctx // PS
    indptr = torch.arange(0, bs + 1, dtype=torch.int32) * pages_per
    indices = pt[1:].reshape(-1).contiguous()
    last = torch.full((bs,), PS, dtype=torch.int32)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=hq // hkv >= 4)
    wrapper.plan(indptr.cuda(), indices, last.cuda(), hq, hkv, D, PS, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, sm_scale=D**-0.5)
    kv = (pool.k[0].view(-1, PS, hkv, D), pool.v[0].view(-1, PS, hkv, D))
    wrapper.run(q, kv)
    return do_bench(lambda: wrapper.run(q, kv), warmup=25, rep=100, return_mode="median") / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    bw = copy_bandwidth()
    backends = ["triton", "torch"]
    if flashinfer_available() and importlib.util.find_spec("gpu_worker.attention.flashinfer_backend"):
        backends.append("flashinfer")
    try:
        import flashinfer  # noqa: F401

        backends.append("flashinfer-kernel")
    except ImportError:
        pass
    rows = []
    for model, hq, hkv, ctx, bs in SHAPES:
        nbytes = bs * ctx * hkv * D * 2 * 2 + 2 * bs * hq * D * 2
        for name in backends:
            key = {"backend": name, "model": model, "ctx": ctx, "bs": bs}
            try:
                sec = bench_backend(name, bs, ctx, hq, hkv)
            except Exception as exc:  # noqa: BLE001 - report, keep going
                rows.append(key | {"error": f"{type(exc).__name__}: {exc}"})
                continue
            rows.append(key | {"us": sec * 1e6, "gb_s": nbytes / sec / 1e9, "frac_of_copy_bw": nbytes / sec / bw})
            torch.cuda.empty_cache()
    out = {"copy_bandwidth_bytes_s": bw, "rows": rows}
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
