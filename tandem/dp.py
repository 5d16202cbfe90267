"""``tandem serve --dp-size N``: N engine instances behind one router, run as one service.

Like SGLang's ``--dp-size``, but built from the two pieces users can also run apart: engine i
is a child ``tandem serve`` on 127.0.0.1, port ``--dp-base-port`` + i (default ``--port`` + 1;
on CUDA one visible GPU each; on the CPU they share the cores, one worker thread each unless
--num-threads is given), and a child ``tandem router`` listens on --host/--port in front of
them, its ``/metrics`` carrying every engine's series too (``--engine-metrics``). Every line a
child prints reaches our stderr tagged ``[engine i]`` or ``[router]``. This process imports no
torch: it finds GPUs through ``common.devices``.
Lifecycle: ready once every engine is healthy; SIGTERM/SIGINT goes to every child (engines
drain, the router finishes its streams), stragglers are killed after the grace period. An
engine that dies is ejected by the router (connection refused / health checks) and the rest
keep serving; when every engine is dead, or the router dies, everything stops and the exit
code is 1. Children die with this process (PR_SET_PDEATHSIG): no orphans.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from functools import cache
from typing import TYPE_CHECKING

from common.args import ArgError, ServerArgs

if TYPE_CHECKING:
    import urllib.request

log = logging.getLogger("tandem")

_READY_POLL_S = 0.25


def split_router_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the engines' argv, the router's argv): every ``--router-X [V]`` becomes ``--X [V]``."""
    engine: list[str] = []
    router: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, val = tok.partition("=")
        if name.startswith("--router-"):
            router.append("--" + name[len("--router-"):])
            if eq:
                router.append(val)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                router.extend(argv[i + 1:i + 2])
                i += 1
        else:
            engine.append(tok)
        i += 1
    return engine, router


def _child_setup() -> None:  # runs in the child between fork and exec
    os.setpgrp()  # terminal Ctrl-C reaches only this process; it stops the children in order
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _gpu_ids(n: int) -> list[str]:
    """The first ``n`` GPUs of CUDA_VISIBLE_DEVICES (or of the driver's count), torch-free."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        from common.devices import cuda_devices  # noqa: PLC0415 - loads the NVIDIA driver

        ids = [str(i) for i in range(cuda_devices().count)]
    if len(ids) < n:
        raise ArgError(f"--dp-size: {n} engines need {n} GPUs, {len(ids)} visible")
    return ids[:n]


def _on_cpu(args: ServerArgs) -> bool:
    if args.device != "auto":
        return args.device == "cpu"
    from common.devices import cuda_devices  # noqa: PLC0415

    return cuda_devices().count == 0


def _tag_lines(stream, tag: bytes) -> None:
    """Copy a child's output to ours, each line prefixed with the child's tag (until EOF)."""
    out = sys.stderr.buffer
    for line in iter(stream.readline, b""):
        out.write(tag + line)
        out.flush()
    stream.close()


class DataParallel:
    def __init__(self, args: ServerArgs, engine_argv: list[str], router_argv: list[str]):
        self.n, self.args = args.dp_size, args
        self.engine_argv, self.router_argv = engine_argv, router_argv
        self.base_port = args.dp_base_port or args.port + 1
        self.engines: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.router: subprocess.Popen | None = None
        self.stopping = False

    def _engine_cmd(self, i: int, cpu: bool) -> list[str]:
        a = self.args
        # Engine i seeds unseeded requests from --random-seed + i: with one seed each engine's k-th
        # sampled request would draw the same numbers, and the router spreads alike requests.
        cmd = [sys.executable, "-m", "tandem", "serve", *self.engine_argv, "--dp-size", "1", "--host", "127.0.0.1",
               "--port", str(self.base_port + i), "--random-seed", str(a.random_seed + i)]
        if cpu and a.num_threads is None:
            cmd += ["--num-threads", str(max(1, ((os.cpu_count() or 2) - 1) // self.n))]
        if not cpu:
            cmd += ["--device", "cuda"]  # its one visible GPU (CUDA_VISIBLE_DEVICES), whatever cuda:N was asked
        if a.run_dir:
            cmd += ["--run-dir", os.path.join(a.run_dir, f"dp{i}")]
        if a.transport == "tcp":  # four channel ports per engine, after the engines' HTTP ports
            cmd += ["--tcp-base-port", str((a.tcp_base_port or self.base_port + self.n) + 8 * i)]
        return cmd

    def _start(self, cmd: list[str], env: dict, tag: str) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_child_setup, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        threading.Thread(target=_tag_lines, args=(proc.stdout, f"[{tag}] ".encode()), daemon=True,
                         name=f"log-{tag}").start()
        return proc

    def start(self) -> None:
        cpu = _on_cpu(self.args)
        gpus = None if cpu else _gpu_ids(self.n)
        for i in range(self.n):
            # The checkpoints are local or already in the Hub cache (this process resolved them):
            # the engines read the cache and never ask the Hub again.
            env = dict(os.environ, HF_HUB_OFFLINE="1")
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpus[i]
            self.urls.append(f"http://127.0.0.1:{self.base_port + i}")
            self.engines.append(self._start(self._engine_cmd(i, cpu), env, f"engine {i}"))
            log.info("dp engine %d: %s%s", i, self.urls[-1], f" (GPU {gpus[i]})" if gpus else "")
        a = self.args
        cmd = [sys.executable, "-m", "tandem", "router", "--worker-urls", *self.urls, "--host", a.host,
               "--port", str(a.port), "--log-level", a.log_level, "--health-check-interval-secs", "2",
               "--max-request-body-bytes", str(a.max_request_body_bytes), "--engine-metrics",
               *(["--metrics-require-key"] if a.metrics_require_key else []), *self.router_argv]
        env = dict(os.environ)
        if a.api_key is not None:
            # The router is the public door: it checks the engines' key and sends it to them.
            # Through the environment, not argv, so ps does not show it.
            env["TANDEM_API_KEY"] = a.api_key
        self.router = self._start(cmd, env, "router")

    def wait_ready(self) -> str | None:
        """None once every engine and the router answer /health, else a reason."""
        pending = set(range(self.n))
        router_ok = False
        # Bounded by the children: each one either answers /health or exits.
        while pending or not router_ok:
            if self.stopping:
                return "interrupted during start-up"
            for i, p in enumerate(self.engines):
                if p.poll() is not None:
                    return f"engine {i} exited with code {p.returncode} during start-up"
            if self.router is not None and self.router.poll() is not None:
                return f"router exited with code {self.router.returncode} during start-up"
            key = self.args.api_key if self.args.metrics_require_key else None
            for i in list(pending):
                if _healthy(self.urls[i], key):
                    pending.discard(i)
            if not pending:
                router_ok = _healthy(f"http://127.0.0.1:{self.args.port}", key)
            time.sleep(_READY_POLL_S)
        return None

    def watch(self) -> int:
        dead: set[int] = set()
        while not self.stopping:
            time.sleep(0.5)
            assert self.router is not None
            if self.router.poll() is not None and not self.stopping:
                log.error("router exited with code %s; stopping the engines", self.router.returncode)
                self.stop()
                return 1
            for i, p in enumerate(self.engines):
                if i not in dead and p.poll() is not None:
                    dead.add(i)
                    log.error("dp engine %d (%s) exited with code %s; the router ejects it (%d of %d left)",
                              i, self.urls[i], p.returncode, self.n - len(dead), self.n)
            if len(dead) == self.n and not self.stopping:
                log.error("every engine is dead; stopping")
                self.stop()
                return 1
        self.stop()
        return 0

    def request_stop(self, *_) -> None:
        self.stopping = True

    def stop(self) -> None:
        procs = [p for p in (*self.engines, self.router) if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.shutdown_timeout + 10.0
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("pid %d outlived the grace period; killing it", p.pid)
                p.kill()
                p.wait(5.0)


@cache
def _no_proxy() -> urllib.request.OpenerDirector:
    """Opened on first use: urllib.request loads ssl and hashlib (~5 MB), which ``tandem serve``
    without --dp-size (it imports this module for ``split_router_args``) never needs."""
    import urllib.request  # noqa: PLC0415

    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _healthy(url: str, api_key: str | None = None) -> bool:
    """``api_key``: with --metrics-require-key /health wants it too."""
    import urllib.request  # noqa: PLC0415 (see _no_proxy; URLError is an OSError)

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with _no_proxy().open(urllib.request.Request(url + "/health", headers=headers), timeout=2.0) as r:
            return r.status == 200
    except OSError:
        return False


def serve_dp(args: ServerArgs, engine_argv: list[str], router_argv: list[str]) -> int:
    dp = DataParallel(args, engine_argv, router_argv)
    signal.signal(signal.SIGTERM, dp.request_stop)
    signal.signal(signal.SIGINT, dp.request_stop)
    try:
        dp.start()
    except ArgError as exc:
        print(f"tandem serve: error: {exc}", file=sys.stderr)
        dp.stop()
        return 2
    reason = dp.wait_ready()
    if reason is not None:
        log.error("start-up failed: %s", reason)
        dp.stop()
        return 1
    log.info("ready: %d engines behind the router at http://%s:%d (engines on 127.0.0.1:%d-%d)", dp.n, args.host,
             args.port, dp.base_port, dp.base_port + dp.n - 1)
    return dp.watch()
