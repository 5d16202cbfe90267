"""Child processes carry their role in ps: the title (cmdline) and the kernel's 15-character
name (comm), instead of the interpreter's command line (``python -c ...``, tandem/launch.py)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tandem.child import _name_process, process_names


def _named(role: str, tp_size: int, conn) -> None:
    _name_process(role, tp_size)
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().rstrip(b"\0").decode()
    with open("/proc/self/comm") as f:
        conn.send((cmdline, f.read().strip()))


@pytest.mark.parametrize("role,tp,title,comm", [
    ("tokenizer", 1, "tandem-front", "tandem-front"),
    ("scheduler", 1, "tandem-scheduler", "tandem-schedule"),
    ("worker", 1, "tandem-worker", "tandem-worker"),
    ("worker", 2, "tandem-worker-rank0", "tandem-worker"),
    ("worker1", 2, "tandem-worker-rank1", "tandem-worker1"),
])
def test_names(role, tp, title, comm):
    assert process_names(role, tp) == (title, comm)


def test_a_spawned_child_shows_its_title_in_ps():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_named, args=("scheduler", 1, child))
    proc.start()
    try:
        assert parent.poll(60)
        assert parent.recv() == ("tandem-scheduler", "tandem-schedule")
    finally:
        proc.join(10)
