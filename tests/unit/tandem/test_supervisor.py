"""The supervisor's restart policy with stand-in children (no model): back-off, give-up after
--max-engine-restarts, a dead front is never restarted, and every child is reaped."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from common.args import ServerArgs
from tandem import supervisor
from tandem.supervisor import Supervisor, restart_backoff
from tests.unit.front_tok import shared_tokenizer_dir
from tests.unit.supervisor_children import fake_child


def test_backoff_doubles_and_caps():
    assert [restart_backoff(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert restart_backoff(50) == supervisor.BACKOFF_S[1]


_STARTED: list[Supervisor] = []


@pytest.fixture(autouse=True)
def _no_child_left():
    """A test that fails half-way must not leave its children running: they are not daemons,
    so pytest would hang at exit joining them (multiprocessing's atexit hook)."""
    yield
    while _STARTED:
        sup = _STARTED.pop()
        for proc in sup.procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        shutil.rmtree(sup.run_dir, ignore_errors=True)


def _sup(monkeypatch, crash: str, **kw) -> Supervisor:
    monkeypatch.setenv("TANDEM_TEST_CRASH", crash)
    monkeypatch.setattr(supervisor, "BACKOFF_S", (0.05, 0.1))
    args = ServerArgs(model_path=shared_tokenizer_dir("chatml"), log_level="warning", shutdown_timeout=1.0, **kw)
    sup = Supervisor(args, entry=fake_child)
    _STARTED.append(sup)
    sup.start()
    assert sup.wait_ready() is None
    return sup


def _all_reaped(pids) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_crash_loop_gives_up_with_exit_1(monkeypatch):
    sup = _sup(monkeypatch, "worker", restart_on_failure=True, max_engine_restarts=2)
    spawned = set()
    real_spawn = sup._spawn

    def spawn(role):
        real_spawn(role)
        spawned.add(sup.procs[role].pid)

    sup._spawn = spawn
    first = {p.pid for p in sup.procs.values()}
    t0 = time.monotonic()
    assert sup.watch() == 1
    assert sup.failures == 3 and len(spawned) == 4  # two restarts of (worker, scheduler)
    assert time.monotonic() - t0 < 15
    assert _all_reaped(first | spawned)


@pytest.mark.parametrize("restart", [True, False])
def test_dead_front_is_not_restarted(monkeypatch, restart):
    sup = _sup(monkeypatch, "none", restart_on_failure=restart)
    pids = {p.pid for p in sup.procs.values()}
    os.kill(sup.procs["tokenizer"].pid, signal.SIGKILL)
    assert sup.watch() == 1 and sup.failures == 0
    assert _all_reaped(pids)


def test_without_restart_an_engine_death_exits_1(monkeypatch):
    sup = _sup(monkeypatch, "worker")
    pids = {p.pid for p in sup.procs.values()}
    assert sup.watch() == 1 and sup.failures == 0
    assert _all_reaped(pids)


def test_front_that_drained_by_itself_means_exit_0(monkeypatch):
    monkeypatch.setenv("TANDEM_TEST_FRONT_EXIT0", "1")
    sup = _sup(monkeypatch, "none", restart_on_failure=True)
    pids = {p.pid for p in sup.procs.values()}
    assert sup.watch() == 0 and sup.failures == 0
    assert _all_reaped(pids)


def test_engine_dead_reaches_a_front_that_connects_late(monkeypatch):
    """EngineDead must not be lost when the front's end is slow to connect (a busy front, a
    CURVE handshake): the supervisor sends it on a channel it keeps open, so it is delivered
    once the connection is up. Here the outputs PULL binds only after the announcement."""
    import zmq

    from proto.messages import EngineDead
    from proto.transport import PullChannel

    sup = _sup(monkeypatch, "none")
    pids = {p.pid for p in sup.procs.values()}
    ctx = zmq.Context()
    try:
        sup._announce_death("worker process died (exit code -9)")
        # The stand-in front binds nothing: the announcement went out before any front was there.
        late = PullChannel(ctx, "outputs", sup.endpoints.outputs)
        try:
            msg = late.recv(timeout_ms=3000)
        finally:
            late.close()
        assert msg == EngineDead("worker process died (exit code -9)")
    finally:
        ctx.term()
        sup.stop(grace=1.0)
    assert _all_reaped(pids)
