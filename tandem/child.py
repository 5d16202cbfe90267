"""Entry point of every child process: detach from terminal signals, die with the parent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def _linux_prctl(role: str) -> None:
    """Linux: SIGKILL this process if the supervisor dies (no orphan survives it), and name it
    ``tandem-<role>`` in ps / top / /proc/PID/comm."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(f"tandem-{role}"[:15].encode()))
    except OSError:
        pass


def child_main(role: str, args, endpoints, status_conn, parent_pid: int | None = None, **worker_kw) -> None:
    """``worker_kw``: the TP rank and rendezvous of a worker process (``rank``, ``init_method``)."""
    os.setpgrp()  # Ctrl-C reaches the supervisor only; it stops children in order
    _linux_prctl(role)
    # The supervisor died before we armed the death signal. (Compared with its pid, not 1: in a
    # container the supervisor itself may be PID 1.)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)
    from proto.transport import use_endpoint_security  # noqa: PLC0415

    use_endpoint_security(endpoints)  # tcp:// channels: this process's CURVE keys
    if role.startswith("worker"):  # "worker" = rank 0, "worker1".. = TP followers
        from gpu_worker.tp_worker import run_rank

        run_rank(args, endpoints, status_conn, **worker_kw)
        return
    if role == "scheduler":
        from scheduler_proc.main import run
    elif role == "tokenizer":
        from tokenizer_proc.main import run
    else:
        raise ValueError(role)
    run(args, endpoints, status_conn)
