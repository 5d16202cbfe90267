"""Start the three processes, report ready, watch them, stop them.

Failure rule: if any child dies, push EngineDead to the front (it fails every in-flight request
with an error and turns /health to 503), stop the rest and exit non-zero. SIGTERM / SIGINT:
the front drains (503 on /health, in-flight requests finish or fail after
--shutdown-timeout), then tells the scheduler, which tells the worker; stragglers are killed.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import signal
import time
import uuid
from multiprocessing.connection import wait

import zmq

from proto.args import ServerArgs
from proto.messages import EngineDead
from proto.transport import Endpoints, PushChannel, ipc_endpoints, make_run_dir, tcp_endpoints
from tandem.child import child_main

log = logging.getLogger("tandem")
ROLES = ("worker", "scheduler", "tokenizer")


def worker_roles(tp_size: int) -> list[str]:
    """One worker process per TP rank: "worker" (rank 0, talks to the scheduler), "worker1".."""
    return ["worker"] + [f"worker{r}" for r in range(1, tp_size)]


class Supervisor:
    def __init__(self, args: ServerArgs):
        self.args = args
        self.run_dir = make_run_dir(args.run_dir)
        if args.transport == "tcp":
            self.endpoints: Endpoints = tcp_endpoints("127.0.0.1", args.tcp_base_port or args.port + 1)
        else:
            self.endpoints = ipc_endpoints(self.run_dir)
        self.procs: dict[str, mp.process.BaseProcess] = {}
        self.status: dict[str, object] = {}
        self.stopping = False

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        # TP ranks meet at a FileStore in the private run dir, fresh per start.
        init_method = "file://" + f"{self.run_dir}/tp-{uuid.uuid4().hex}.store"
        for role in [*worker_roles(self.args.tp_size), *ROLES[1:]]:
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            kw = {}
            if role.startswith("worker"):
                kw = {"rank": int(role[6:] or 0), "init_method": init_method}
            proc = ctx.Process(target=child_main, args=(role, self.args, self.endpoints, child_conn), kwargs=kw,
                               name=f"tandem-{role}", daemon=False)
            proc.start()
            child_conn.close()
            self.procs[role] = proc
            self.status[role] = parent_conn

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

    def watch(self) -> int:
        """Block until shutdown or a child's death; returns the exit code."""
        sentinels = {p.sentinel: role for role, p in self.procs.items()}
        while not self.stopping:
            dead = wait(list(sentinels), timeout=0.5)
            if dead:
                role = sentinels[dead[0]]
                code = self.procs[role].exitcode
                if self.stopping:  # children exit in order during a requested shutdown
                    break
                log.error("%s process died (exit code %s); failing in-flight requests", role, code)
                self._announce_death(f"{role} process died (exit code {code})")
                self.stop(grace=2.0)
                return 1
        self.stop(grace=self.args.shutdown_timeout + 5.0)
        return 0

    def _announce_death(self, reason: str) -> None:
        ctx = zmq.Context()
        try:
            chan = PushChannel(ctx, "outputs", self.endpoints.outputs)
            chan.send(EngineDead(reason))
            time.sleep(0.5)  # let the front fail its requests before it is stopped
            chan.close()
        finally:
            ctx.term()

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
        tok.join(max(0.1, deadline - time.monotonic()))
        for role in ("scheduler", *worker_roles(self.args.tp_size)):  # they exit on the front's Shutdown
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
