"""Paged decode attention over rows of unequal length, launched in the default order and longest
row first (``order``, kernels/attention_decode.py), timed in a CUDA graph, with a bitwise check.

Shape: Qwen3-0.6B (16 q / 8 KV heads, d 128, page 16), the nano-vllm recipe's mix: rows with
contexts uniform in [100, 2048] (its prompts plus outputs), at the batch sizes it passes through.
Bytes = each row's K and V over its context; the ceiling is the copy bandwidth of the same run.

    python benchmarks/lab/launch_order_bench.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.hbm_bandwidth import copy_bandwidth  # noqa: E402
from gpu_worker.attention.triton_backend import decode_splits  # noqa: E402
from gpu_worker.kernels.attention_decode import paged_decode  # noqa: E402

HQ, HKV, D, PS = 16, 8, 128, 16


def case(bs: int, lo: int, hi: int, sms: int, bw: float, seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (bs,), device="cuda", generator=g)
    pages_per_row = (int(lens.max()) + PS - 1) // PS
    n_pages = bs * pages_per_row + 1
    kc = torch.randn(n_pages * PS, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    pt = (torch.randperm(n_pages - 1, device="cuda", generator=g)[: bs * pages_per_row] + 1).view(bs, pages_per_row)
    pt = pt.to(torch.int32)
    slots = torch.arange(bs, device="cuda")
    q = torch.randn(bs, HQ, D, device="cuda", dtype=torch.bfloat16)
    splits = decode_splits(bs, HKV, sms)
    order = torch.argsort(lens, descending=True)
    kw = dict(t=1, page_size=PS, scale=D**-0.5, num_splits=splits)
    outs, times = {}, {}
    from triton.testing import do_bench_cudagraph
    for name, o in (("default", None), ("longest first", order)):
        def run(o=o):
            return paged_decode(q, kc, vc, pt, slots, lens, lens - 1, order=o, **kw)
        outs[name] = run()
        # do_bench_cudagraph runs on a side stream that does not wait for this one: without the
        # sync it read a page table still being written (an illegal address on the H200).
        torch.cuda.synchronize()
        times[name] = do_bench_cudagraph(run, rep=50, return_mode="median") * 1e-3
    nbytes = int(lens.sum()) * HKV * D * 2 * 2
    row = dict(bs=bs, ctx=f"U[{lo}, {hi}]", splits=splits, bitwise_equal=torch.equal(outs["default"], outs["longest first"]))
    for name, sec in times.items():
        row[name] = dict(us=sec * 1e6, frac_of_copy_bw=nbytes / sec / bw)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [case(bs, 100, 2048, sms, bw, seed=bs) for bs in (48, 96, 137, 192, 256)]
    rows.append(case(256, 560, 560, sms, bw, seed=1))  # equal lengths: the order cannot help
    print(f"{'rows':>5} {'contexts':>14} {'default us':>11} {'longest-first us':>17} {'gain':>6} bitwise")
    for r in rows:
        a, b = r["default"], r["longest first"]
        print(f"{r['bs']:5d} {r['ctx']:>14} {a['us']:8.1f} ({a['frac_of_copy_bw']:4.0%}) {b['us']:9.1f} "
              f"({b['frac_of_copy_bw']:4.0%}) {a['us'] / b['us'] - 1:6.1%} {r['bitwise_equal']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(bandwidth=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
