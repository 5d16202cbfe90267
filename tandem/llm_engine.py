"""The engine behind ``tandem.LLM``: the scheduler and worker processes ``tandem serve`` runs,
started by the same ``Supervisor``, with the calling process as their front (it binds the
``outputs`` channel and pushes on ``requests``, as the HTTP front does).

No orphan: the children arm ``PR_SET_PDEATHSIG`` against this process (``tandem/child.py``), so
even a SIGKILLed caller takes them along; ``close`` (``LLM.shutdown``, its ``with`` block, its
garbage collection, the interpreter's exit) stops them in order.
"""

from __future__ import annotations

import shutil
import time

import zmq

from common.args import ServerArgs
from proto.messages import EngineInfo, SchedulerStats, Shutdown
from proto.transport import PullChannel, PushChannel
from tandem.supervisor import Supervisor

STATUS_GRACE_S = 0.5  # after a death, how long a child's own one-line reason may take to arrive


class EngineError(RuntimeError):
    """The engine did not start, or one of its processes died; the message says which and why."""


class EngineLink:
    """Started processes plus the two channels this process holds; ``info`` once they are up."""

    def __init__(self, args: ServerArgs):
        self.sup = Supervisor(args)
        self.zctx = zmq.Context()
        self.outputs: PullChannel = PullChannel(self.zctx, "outputs", self.sup.endpoints.outputs)
        self.requests: PushChannel = PushChannel(self.zctx, "requests", self.sup.endpoints.requests)
        self.stats: SchedulerStats | None = None
        self.closed = False
        self.dead_reason: str | None = None
        try:
            self.sup.start_engine()
            self.info: EngineInfo = self._wait_info()
        except BaseException:
            self.close(timeout=2.0)
            raise

    def _wait_info(self) -> EngineInfo:
        while True:
            msg = self.recv(timeout_ms=200)
            if isinstance(msg, EngineInfo):
                return msg

    # ------------------------------------------------------------------ messages
    def send(self, msg) -> None:
        self.requests.send(msg)

    def recv(self, timeout_ms: int):
        """The next message for the front (stats are kept here, not returned), or None after
        ``timeout_ms``; EngineError when an engine process died."""
        msg = self.outputs.recv(timeout_ms=timeout_ms)
        if msg is None:
            self.check_alive()
        elif isinstance(msg, SchedulerStats):
            self.stats = msg
            return None
        return msg

    def check_alive(self) -> None:
        """EngineError when a process died or reported a failure; the rest are stopped then."""
        dead = [(role, p.exitcode) for role, p in self.sup.procs.items() if not p.is_alive()]
        reason = self._reported_error(STATUS_GRACE_S if dead else 0.0)
        if reason is None and dead:
            reason = f"{dead[0][0]} process exited with code {dead[0][1]}"
        if reason is not None:
            self.dead_reason = reason
            self.close(timeout=2.0)
            raise EngineError(reason)

    def _reported_error(self, wait_s: float) -> str | None:
        """A child's one-line reason for failing (start-up errors come this way)."""
        deadline = time.monotonic() + wait_s
        while True:
            for role, conn in list(self.sup.status.items()):
                try:
                    if conn.poll():
                        kind, detail = conn.recv()
                        if kind == "error":
                            return f"{role}: {detail}"
                except (EOFError, OSError):
                    del self.sup.status[role]  # the child closed its end: it exited
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def idle_stats(self, timeout_s: float = 2.0) -> SchedulerStats | None:
        """The scheduler's stats once it reports nothing running or waiting (sent as it goes
        idle), so that its cumulative counters cover every finished request."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.stats
            if s is not None and s.num_running == 0 and s.num_waiting == 0 and s.num_slots_held == 0:
                return s
            self.recv(timeout_ms=50)
        return self.stats

    # ------------------------------------------------------------------ stopping
    def close(self, timeout: float = 10.0) -> None:
        """Shutdown to the scheduler (it tells the worker), wait for both, kill what is left."""
        if self.closed:
            return
        self.closed = True
        if any(p.is_alive() for p in self.sup.procs.values()):
            self.requests.send(Shutdown("LLM shut down"))
        deadline = time.monotonic() + timeout
        for proc in self.sup.procs.values():
            proc.join(max(0.1, deadline - time.monotonic()))
        self.sup.stop_engine()
        self.outputs.close()
        self.requests.close()
        self.zctx.term()
        shutil.rmtree(self.sup.run_dir, ignore_errors=True)
