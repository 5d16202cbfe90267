"""Start the three processes, report ready, watch them, restart or stop them.

Failure rule: when a child dies, the supervisor pushes EngineDead to the front (it fails every
in-flight request with an explicit error and turns /health to 503). Without
--restart-on-failure it then stops the rest and exits 1. With it, and when the dead child is
the scheduler or the worker, it stops the other engine process, waits a back-off, and starts a
fresh scheduler + worker on the same endpoints (same 0700 run dir); the front stays up, warms
the new engine and serves again. Deaths in a row (an engine that never stays up STABLE_S) back
off 1, 2, 4 ... s and after --max-engine-restarts the supervisor gives up and exits 1. A dead
front is never restarted here: it holds the HTTP port and the streams (the orchestrator
restarts the container).

SIGTERM / SIGINT: the front drains (503 on /health, in-flight requests finish or fail after
--shutdown-timeout), then tells the scheduler, which tells the worker; stragglers are killed.
No orphan: every child is joined (or killed) before its replacement starts or we exit, and
children die with us (PR_SET_PDEATHSIG, tandem/child.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
import uuid
from multiprocessing.connection import Pipe, wait
from typing import Callable

import zmq

from common.args import ServerArgs
from proto.curve import generate_keys
from proto.messages import EngineDead
from proto.transport import Endpoints, PushChannel, ipc_endpoints, make_run_dir, tcp_endpoints, use_endpoint_security
from tandem.child import child_main
from tandem.launch import ChildProcess

log = logging.getLogger("tandem")
ROLES = ("worker", "scheduler", "tokenizer")
STABLE_S = 60.0  # an engine that ran this long before dying starts the back-off from scratch
BACKOFF_S = (1.0, 30.0)  # first and largest wait before a restart


def restart_backoff(failures: int) -> float:
    """Seconds to wait before restart number ``failures`` of a row (1, 2, 4, ... capped)."""
    first, cap = BACKOFF_S
    return min(cap, first * 2 ** max(0, failures - 1))


def worker_roles(tp_size: int) -> list[str]:
    """One worker process per TP rank: "worker" (rank 0, talks to the scheduler), "worker1".."""
    return ["worker"] + [f"worker{r}" for r in range(1, tp_size)]


class Supervisor:
    def __init__(self, args: ServerArgs, entry: Callable = child_main):
        self.args = args
        self.entry = entry
        self.run_dir = make_run_dir(args.run_dir)
        if args.transport == "tcp":
            keys_dir = args.curve_keys_dir
            if keys_dir is None:  # one host: fresh keys, readable only by us
                keys_dir = os.path.join(self.run_dir, "curve")
                generate_keys(keys_dir)
            self.endpoints: Endpoints = tcp_endpoints("127.0.0.1", args.tcp_base_port or args.port + 1, keys_dir)
        else:
            self.endpoints = ipc_endpoints(self.run_dir)
        use_endpoint_security(self.endpoints)  # our own EngineDead push is a channel client too
        self.procs: dict[str, ChildProcess] = {}
        self.status: dict[str, object] = {}
        self.stopping = False
        self.failures = 0  # engine deaths in a row
        self.death_announced = False  # the front was told the current engine is dead
        self.engine_started = 0.0
        # EngineDead goes out on one channel opened at start and kept: connected (and through its
        # CURVE handshake on tcp) long before a death. A channel opened at the death and closed
        # 0.5 s later (linger 0) lost the message whenever connecting took longer, and the front,
        # never told, left every in-flight request hanging.
        self._zctx: zmq.Context | None = None
        self._announcer: PushChannel | None = None

    # ------------------------------------------------------------------ children
    @property
    def engine_roles(self) -> list[str]:
        return [*worker_roles(self.args.tp_size), "scheduler"]

    def _new_engine(self) -> None:
        """TP ranks meet at a FileStore in the private run dir, fresh per engine start."""
        self.init_method = "file://" + f"{self.run_dir}/tp-{uuid.uuid4().hex}.store"

    def _spawn(self, role: str) -> None:
        parent_conn, child_conn = Pipe(duplex=False)
        kw = {"rank": int(role[6:] or 0), "init_method": self.init_method} if role.startswith("worker") else {}
        proc = ChildProcess(self.entry, (role, self.args, self.endpoints, child_conn, os.getpid()), kw,
                            name=f"tandem-{role}")
        proc.start()
        child_conn.close()
        self.procs[role] = proc
        self.status[role] = parent_conn

    def start(self) -> None:
        self._zctx = zmq.Context()
        self._announcer = PushChannel(self._zctx, "outputs", self.endpoints.outputs)
        self.start_engine()
        self._spawn("tokenizer")

    def start_engine(self) -> None:
        """The scheduler and the worker process(es), on this supervisor's endpoints; whoever
        binds ``outputs`` is their front (the HTTP front, or ``tandem.LLM`` in its own process)."""
        self._new_engine()
        for role in self.engine_roles:
            self._spawn(role)
        self.engine_started = time.monotonic()

    def wait_ready(self) -> str | None:
        """None when the front reported ready, else a one-line reason."""
        while True:
            ready = wait([*self.status.values(), *(p.sentinel for p in self.procs.values())], timeout=1.0)
            if self.stopping:
                return "interrupted during start-up"
            for role, conn in self.status.items():
                if conn in ready:
                    try:
                        kind, detail = conn.recv()
                    except EOFError:
                        continue
                    if kind == "ready":
                        return None
                    return f"{role}: {detail}"
            for role, proc in self.procs.items():
                if proc.sentinel in ready:
                    return f"{role} process exited with code {proc.exitcode} during start-up"

    # ------------------------------------------------------------------ watching
    def watch(self) -> int:
        """Block until shutdown or an unrecoverable death; returns the exit code."""
        while not self.stopping:
            sentinels = {p.sentinel: role for role, p in self.procs.items()}
            conns = {conn: role for role, conn in self.status.items()}
            ready = wait([*sentinels, *conns], timeout=0.5)
            for conn in [c for c in ready if c in conns]:
                self._on_status(conns[conn], conn)
            dead = [sentinels[s] for s in ready if s in sentinels]
            if not dead or self.stopping:  # children exit in order during a requested shutdown
                continue
            role = dead[0]
            self.procs[role].join(1.0)  # reap it: exitcode is known only once waited for
            code = self.procs[role].exitcode
            if role == "tokenizer" and code == 0:  # the front was signalled itself and drained
                log.info("front exited after draining; stopping")
                self.stopping = True
                break
            log.error("%s process died (exit code %s); failing in-flight requests", role, code)
            if role == "tokenizer" or not self.args.restart_on_failure:
                self._announce_death(f"{role} process died (exit code {code})")
                self.stop(grace=2.0)
                return 1
            if not self._restart_engine(role, code):
                self.stop(grace=2.0)
                return 1
        self.stop(grace=self.args.shutdown_timeout + 5.0)
        return 0

    def _on_status(self, role: str, conn) -> None:
        try:
            kind, detail = conn.recv()
        except (EOFError, OSError):
            del self.status[role]  # the child closed its end (it exited); its sentinel says so
            return
        if kind == "ready" and role == "tokenizer":
            log.info("engine restarted and warm: serving again")
        elif kind == "error":
            log.error("%s: %s", role, detail)

    def _restart_engine(self, role: str, code: int | None) -> bool:
        """Replace scheduler + worker. False when the crash loop hit --max-engine-restarts."""
        uptime = time.monotonic() - self.engine_started
        self.failures = 1 if uptime >= STABLE_S else self.failures + 1
        give_up = self.failures > self.args.max_engine_restarts
        note = "giving up" if give_up else "restarting the engine"
        self._announce_death(f"{role} process died (exit code {code}); {note}")
        self.stop_engine()
        if give_up:
            log.error("engine died %d times in a row (--max-engine-restarts %d): giving up",
                      self.failures, self.args.max_engine_restarts)
            return False
        delay = restart_backoff(self.failures)
        log.warning("restarting the engine in %.0f s (failure %d of at most %d in a row)", delay, self.failures,
                    self.args.max_engine_restarts)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and not self.stopping:
            time.sleep(0.05)
        if self.stopping:
            return True  # watch() sees it and stops in order
        self.start_engine()
        self.death_announced = False
        return True

    def stop_engine(self) -> None:
        """Scheduler and worker, whichever is left: SIGTERM, then SIGKILL; all joined (no orphan)."""
        procs = [self.procs[r] for r in self.engine_roles if r in self.procs]
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for r in self.engine_roles:
            conn = self.status.pop(r, None)
            if conn is not None:
                conn.close()

    def _announce_death(self, reason: str) -> None:
        self.death_announced = True
        if self._announcer is None:  # not started: there is no front to tell
            return
        self._announcer.send(EngineDead(reason))
        time.sleep(0.5)  # let the front fail its requests before anything else happens

    # ------------------------------------------------------------------ stopping
    def request_stop(self, *_):
        self.stopping = True
        tok = self.procs.get("tokenizer")
        if tok is not None and tok.is_alive():
            tok.terminate()  # SIGTERM: the front drains, then shuts the engine down

    def stop(self, grace: float) -> None:
        """Front first (it drains), then the engine; SIGKILL what outlives the grace period."""
        deadline = time.monotonic() + grace
        tok = self.procs["tokenizer"]
        if tok.is_alive() and not self.stopping:
            tok.terminate()
        self._wait_front(deadline)
        for role in self.engine_roles:  # they exit on the Shutdown the front sent
            self.procs[role].join(max(0.1, min(2.0, deadline - time.monotonic())))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self._announcer is not None:
            self._announcer.close()
            self._zctx.term()
            self._announcer = self._zctx = None


    def _wait_front(self, deadline: float) -> None:
        """Wait for the front to finish draining. An engine process that dies meanwhile (not
        the exit 0 that follows the front's Shutdown) is announced at once, so the requests
        still draining end with an error now rather than at the shutdown timeout."""
        tok = self.procs["tokenizer"]
        while tok.is_alive() and time.monotonic() < deadline:
            engine = [self.procs[r] for r in self.engine_roles if r in self.procs and self.procs[r].is_alive()]
            wait([tok.sentinel, *(p.sentinel for p in engine)], timeout=max(0.0, min(0.5, deadline - time.monotonic())))
            for r in self.engine_roles:
                proc = self.procs.get(r)
                if self.death_announced or proc is None or proc.is_alive() or proc.exitcode in (0, None):
                    continue
                log.error("%s process died (exit code %s) during shutdown", r, proc.exitcode)
                self._announce_death(f"{r} process died (exit code {proc.exitcode}) during shutdown")
        tok.join(max(0.1, deadline - time.monotonic()))


def serve(args: ServerArgs) -> int:
    sup = Supervisor(args)
    signal.signal(signal.SIGTERM, sup.request_stop)
    signal.signal(signal.SIGINT, sup.request_stop)
    sup.start()
    reason = sup.wait_ready()
    if reason is not None:
        log.error("start-up failed: %s", reason)
        sup.stop(grace=2.0)
        return 1
    log.info("ready: serving %s at http://%s:%d", args.model_name, args.host, args.port)
    return sup.watch()
