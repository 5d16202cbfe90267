"""Entry point of every child process: detach from terminal signals, die with the parent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import setproctitle

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def process_names(role: str, tp_size: int) -> tuple[str, str]:
    """(the title ``ps`` shows, the 15-character name in /proc/PID/comm, ``top`` and ``ps -e``)
    of a child: tandem-front, tandem-scheduler, tandem-worker (TP: tandem-worker-rankN)."""
    if role == "tokenizer":
        return "tandem-front", "tandem-front"
    if role.startswith("worker"):
        rank = int(role[6:] or 0)
        if tp_size == 1:
            return "tandem-worker", "tandem-worker"
        return f"tandem-worker-rank{rank}", f"tandem-worker{rank or ''}"[:15]
    return f"tandem-{role}", f"tandem-{role}"[:15]


def _name_process(role: str, tp_size: int) -> None:
    title, comm = process_names(role, tp_size)
    setproctitle.setproctitle(title)  # the argv ps shows, instead of multiprocessing's spawn command
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(comm.encode()))
        except OSError:
            pass


def _die_with_parent() -> None:
    """Linux: SIGKILL this process if the supervisor dies (no orphan survives it)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def child_main(role: str, args, endpoints, status_conn, parent_pid: int | None = None, **worker_kw) -> None:
    """``worker_kw``: the TP rank and rendezvous of a worker process (``rank``, ``init_method``)."""
    os.setpgrp()  # Ctrl-C reaches the supervisor only; it stops children in order
    _die_with_parent()
    _name_process(role, args.tp_size)
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
