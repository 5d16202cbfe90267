"""Tensor-parallel process state: this rank, the world size, and the two process groups.

One worker process per rank. ``device_group`` carries the model's collectives (NCCL on CUDA,
gloo on the CPU); ``cpu_group`` (gloo) carries start-up agreement (pool size, fan-out
addresses), so nothing host-side ever goes through NCCL. With no group initialised the state
is TP=1: every helper is a no-op and the model factories build today's plain modules.

Invariant: all ranks execute the same sequence of collectives on ``device_group`` (they run
the same plans through the same code), so no collective ever pairs with a different one.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Start-up and step collectives only (idle ranks wait on a ZMQ socket, never in a collective),
# so a rank stuck this long in one means a peer hung: fail rather than wait for ever.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class TPState:
    rank: int
    size: int
    device_group: object | None
    cpu_group: object | None


_STATE = TPState(0, 1, None, None)


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def device_group():
    return _STATE.device_group


def cpu_group():
    return _STATE.cpu_group


def rank_device(device: torch.device, rank: int | None = None) -> torch.device:
    """The device of ``rank``: ``cuda:(base + rank)`` on CUDA (base = the index asked for,
    default 0), the CPU unchanged."""
    rank = tp_rank() if rank is None else rank
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def init_tp(rank: int, size: int, init_method: str, device: torch.device) -> TPState:
    """Join the TP world: NCCL for the model on CUDA (gloo on the CPU), plus a gloo group for
    host-side agreement. Idempotent for size 1 (no group at all)."""
    global _STATE
    if size == 1:
        _STATE = TPState(0, 1, None, None)
        return _STATE
    if device.type == "cuda":
        n = torch.cuda.device_count()
        first = device.index or 0
        if first + size > n:
            raise ValueError(f"--tp-size {size}: needs {size} CUDA devices from cuda:{first}, {n} visible")
        torch.cuda.set_device(rank_device(device, rank))
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = dict(backend=backend, init_method=init_method, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    if backend == "nccl":
        kw["device_id"] = rank_device(device, rank)  # eager NCCL init: fail at start-up, not step 1
    dist.init_process_group(**kw)
    world = dist.group.WORLD
    cpu = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend == "nccl" else world
    _STATE = TPState(rank, size, world, cpu)
    return _STATE


def destroy_tp() -> None:
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = TPState(0, 1, None, None)


def agree_min(value: int) -> int:
    """The smallest ``value`` over all ranks (e.g. KV pages: every rank must size its pool
    alike, and the smallest free memory decides)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group())
    return int(t.item())


def all_gather_object(obj) -> list:
    if tp_size() == 1:
        return [obj]
    out: list = [None] * tp_size()
    dist.all_gather_object(out, obj, group=cpu_group())
    return out

