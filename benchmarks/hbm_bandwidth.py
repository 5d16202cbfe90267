"""Measure the device's memory-bandwidth ceiling in the same run as the benchmarks.

A large device-to-device copy reads and writes every byte once: bandwidth = 2 * bytes / time.
Also prints the weight-streaming floor of one decode step for a model directory:
bytes of weights / bandwidth (the time a bandwidth-bound step cannot beat).
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def copy_bandwidth(gib: float = 4.0, iters: int = 20) -> float:
    n = int(gib * (1 << 30)) // 4
    a = torch.empty(n, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    secs = start.elapsed_time(end) / 1e3
    return 2 * a.numel() * 4 * iters / secs


def weight_bytes(model_dir: str, dtype_bytes: int = 2) -> int:
    from safetensors import safe_open

    total = 0
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), "pt") as f:
                for k in f.keys():
                    total += _numel(f.get_slice(k).get_shape()) * dtype_bytes
    return total


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", action="append", default=[])
    a = ap.parse_args()
    bw = copy_bandwidth()
    out = {"device": torch.cuda.get_device_name(), "hbm_copy_bandwidth_bytes_s": bw}
    for d in a.model_path:
        wb = weight_bytes(d)
        out[d] = {"weight_bytes_bf16": wb, "decode_step_floor_s": wb / bw}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
