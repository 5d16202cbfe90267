"""Collectives on the device group. Each is the identity at TP=1, so model code calls them
unconditionally and TP=1 runs exactly today's arithmetic."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gpu_worker.parallel.state import device_group, tp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place. Row-parallel outputs and the vocab-parallel embedding use it;
    with NCCL it is capturable in a CUDA graph (it runs on the current stream)."""
    if tp_size() == 1:
        return x
    dist.all_reduce(x, group=device_group())
    return x


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there).
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """[..., n] per rank -> [..., tp * n], rank r's block at columns [r*n, (r+1)*n)."""
    if tp_size() == 1:
        return x
    tp, n = tp_size(), x.shape[-1]
    flat = x.reshape(-1, n).contiguous()
    # One collective into one buffer (capturable with NCCL), then rank blocks side by side.
    out = flat.new_empty(tp * flat.shape[0], n)
    _gather_single(out, flat, group=device_group())
    out = out.view(tp, flat.shape[0], n).permute(1, 0, 2).reshape(*x.shape[:-1], tp * n)
    return out


def warmup() -> None:
    """One tiny all-reduce so NCCL builds its communicators before any CUDA-graph capture
    (communicator set-up cannot be captured)."""
    if tp_size() == 1:
        return
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    all_reduce(torch.zeros(1, device=dev))
