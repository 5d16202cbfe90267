"""Helpers for the e2e tests that watch processes: whether one lives, waiting for a condition.
(Streams that record how they ended and a server's engine processes: ``benchmarks/stream_ends.py``,
shared with ``ops_bench.py``.)"""

from __future__ import annotations

import time

import httpx


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(pred, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    return False
