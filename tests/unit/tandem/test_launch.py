"""tandem/launch.py: children as fresh interpreters, the part of multiprocessing.Process the
supervisor uses, and no multiprocessing resource tracker (a ~13 MB process nothing here uses)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from multiprocessing.connection import Pipe, wait

import pytest

from tandem.launch import ChildProcess
from tests.helpers.server import ROOT
from tests.unit.tandem import launch_children


def _run(target, *args, **kwargs) -> ChildProcess:
    proc = ChildProcess(target, args, kwargs, name="test-child")
    proc.start()
    return proc


def test_a_connection_crosses_and_the_child_sees_our_path_and_no_stdin():
    ours, theirs = Pipe(duplex=False)
    sys.path.insert(0, "/nonexistent/tandem-launch-test")
    try:
        proc = _run(launch_children.report, theirs, "hello", times=2)
    finally:
        sys.path.pop(0)
    theirs.close()
    try:
        assert ours.poll(60)
        word, path, stdin = ours.recv()
        assert word == "hello" and path[0] == "/nonexistent/tandem-launch-test" and stdin == "/dev/null"
        assert ours.recv()[0] == "hello"
        proc.join(30)
        assert proc.exitcode == 0 and not proc.is_alive()
        with pytest.raises(EOFError):  # the child's end closed with it
            ours.recv()
    finally:
        proc.kill()


@pytest.mark.parametrize("code,expected", [(None, 0), (3, 3), ("a message", 1)])
def test_exit_codes_as_multiprocessing_reports_them(code, expected):
    proc = _run(launch_children.exit_with, code)
    proc.join(60)
    assert proc.exitcode == expected


def test_an_uncaught_exception_exits_1_with_its_traceback(capfd):
    proc = _run(launch_children.fail)
    proc.join(60)
    assert proc.exitcode == 1
    assert "RuntimeError: boom in the child" in capfd.readouterr().err


def test_sentinel_wakes_on_death_and_signals_give_negative_codes():
    proc = _run(launch_children.sleep_forever)
    assert proc.is_alive() and proc.exitcode is None
    assert wait([proc.sentinel], timeout=0.2) == []
    proc.terminate()
    assert wait([proc.sentinel], timeout=60) == [proc.sentinel]
    proc.join(10)
    assert proc.exitcode == -signal.SIGTERM and not proc.is_alive()
    proc.kill()  # after the reap: a no-op, not a signal to a recycled pid


def test_starting_children_starts_no_resource_tracker():
    code = textwrap.dedent("""
        import os, sys
        from multiprocessing.connection import Pipe
        from tandem.launch import ChildProcess
        from tests.unit.tandem.launch_children import report
        ours, theirs = Pipe(duplex=False)
        proc = ChildProcess(report, (theirs, "x"))
        proc.start()
        theirs.close()
        assert ours.recv()[0] == "x"
        proc.join(30)
        def child_cmdline(pid):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] != str(os.getpid()):
                        return None
                with open(f"/proc/{pid}/cmdline") as f:
                    return f.read()
            except (OSError, IndexError):  # gone meanwhile
                return None
        cmdlines = [c for c in map(child_cmdline, filter(str.isdigit, os.listdir("/proc"))) if c is not None]
        assert not any("resource_tracker" in c for c in cmdlines), cmdlines
        assert "multiprocessing.resource_tracker" not in sys.modules
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
