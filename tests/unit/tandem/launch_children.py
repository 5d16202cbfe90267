"""Targets for tests/unit/tandem/test_launch.py (a light module: the child imports it by name)."""

from __future__ import annotations

import os
import sys
import time


def report(conn, word: str, *, times: int = 1) -> None:
    """Sends what the child sees: the argument, its sys.path head and its stdin."""
    for _ in range(times):
        conn.send((word, sys.path[:3], os.path.realpath(f"/proc/self/fd/{sys.stdin.fileno()}")))
    conn.close()


def exit_with(code) -> None:
    sys.exit(code)


def fail() -> None:
    raise RuntimeError("boom in the child")


def sleep_forever() -> None:
    while True:
        time.sleep(0.1)
