"""``tandem serve --dp-size N``: N engine instances behind one router, run as one service.

Like SGLang's ``--dp-size``, but built from the two pieces users can also run apart: each
engine is a child ``tandem serve`` on a free loopback port (on CUDA one visible GPU each; on
the CPU they share the cores, one worker thread each unless --num-threads is given), and a
child ``tandem router`` listens on --host/--port in front of them.
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
import socket
import subprocess
import sys
import time

import urllib.error
import urllib.request

from common.args import ArgError, ServerArgs

log = logging.getLogger("tandem")

DP_HELP = """
data parallelism (N engines behind one router on --port):
  --dp-size N, --data-parallel-size N
                        run N engine instances (CUDA: one GPU each; CPU: sharing the cores)
                        behind a cache-aware router (default 1: a single engine, no router)
  --router-<flag> V     passed to the router as --<flag> V (e.g. --router-policy round_robin,
                        --router-cache-threshold 0.5); see `tandem router --help`"""

_DP_FLAGS = ("--dp-size", "--data-parallel-size", "--dp")
_READY_POLL_S = 0.25


def _dp_value(flag: str, raw: str | None) -> int:
    if raw is None or not raw.lstrip("-").isdigit():
        raise ArgError(f"{flag}: expected a positive integer, got {raw!r}")
    value = int(raw)
    if value < 1:
        raise ArgError(f"{flag}: must be >= 1, got {value}")
    return value


def split_dp_args(argv: list[str]) -> tuple[int | None, list[str], list[str]]:
    """(dp size or None for a single engine, the engines' argv, the router's argv)."""
    dp: int | None = None
    engine: list[str] = []
    router: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, val = tok.partition("=")
        if name in _DP_FLAGS:
            if not eq:
                val = argv[i + 1] if i + 1 < len(argv) else None
                i += 1
            dp = _dp_value(name, val)
        elif name.startswith("--router-"):
            router.append("--" + name[len("--router-"):])
            if eq:
                router.append(val)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                router.extend(argv[i + 1:i + 2])
                i += 1
        else:
            engine.append(tok)
        i += 1
    if router and (dp is None or dp == 1):
        raise ArgError(f"{router[0].replace('--', '--router-', 1)}: router flags need --dp-size N with N > 1")
    return (dp if dp and dp > 1 else None), engine, router


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_setup() -> None:  # runs in the child between fork and exec
    os.setpgrp()  # terminal Ctrl-C reaches only this process; it stops the children in order
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _gpu_ids(n: int) -> list[str]:
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [
        str(i) for i in range(torch.cuda.device_count())]
    if len(ids) < n:
        raise ArgError(f"--dp-size: {n} engines need {n} GPUs, {len(ids)} visible")
    return ids[:n]


class DataParallel:
    def __init__(self, n: int, args: ServerArgs, engine_argv: list[str], router_argv: list[str]):
        self.n, self.args = n, args
        self.engine_argv, self.router_argv = engine_argv, router_argv
        self.engines: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.router: subprocess.Popen | None = None
        self.stopping = False

    def _engine_cmd(self, i: int, port: int, cpu: bool) -> list[str]:
        a = self.args
        # Engine i seeds unseeded requests from --random-seed + i: with one seed each engine's k-th
        # sampled request would draw the same numbers, and the router spreads alike requests.
        cmd = [sys.executable, "-m", "tandem", "serve", *self.engine_argv, "--host", "127.0.0.1",
               "--port", str(port), "--random-seed", str(a.random_seed + i)]
        if cpu and a.num_threads is None:
            cmd += ["--num-threads", str(max(1, ((os.cpu_count() or 2) - 1) // self.n))]
        if not cpu:
            cmd += ["--device", "cuda"]  # its one visible GPU (CUDA_VISIBLE_DEVICES), whatever cuda:N was asked
        if a.run_dir:
            cmd += ["--run-dir", os.path.join(a.run_dir, f"dp{i}")]
        if a.transport == "tcp":
            cmd += ["--tcp-base-port", str((a.tcp_base_port or a.port + 1) + 8 * i)]
        return cmd

    def start(self) -> None:
        device = self.args.resolved_device()
        cpu = device == "cpu"
        gpus = None if cpu else _gpu_ids(self.n)
        for i in range(self.n):
            port = _free_port()
            env = dict(os.environ)
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpus[i]
            self.engines.append(subprocess.Popen(self._engine_cmd(i, port, cpu), env=env, preexec_fn=_child_setup))
            self.urls.append(f"http://127.0.0.1:{port}")
            log.info("dp engine %d: %s%s", i, self.urls[-1], f" (GPU {gpus[i]})" if gpus else "")
        a = self.args
        cmd = [sys.executable, "-m", "tandem", "router", "--worker-urls", *self.urls, "--host", a.host,
               "--port", str(a.port), "--log-level", a.log_level, "--health-check-interval-secs", "2",
               "--max-request-body-bytes", str(a.max_request_body_bytes),
               *(["--metrics-require-key"] if a.metrics_require_key else []), *self.router_argv]
        env = dict(os.environ)
        if a.api_key is not None:
            # The router is the public door: it checks the engines' key and sends it to them.
            # Through the environment, not argv, so ps does not show it.
            env["TANDEM_API_KEY"] = a.api_key
        self.router = subprocess.Popen(cmd, env=env, preexec_fn=_child_setup)

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


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _healthy(url: str, api_key: str | None = None) -> bool:
    """``api_key``: with --metrics-require-key /health wants it too."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with _NO_PROXY.open(urllib.request.Request(url + "/health", headers=headers), timeout=2.0) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def serve_dp(n: int, args: ServerArgs, engine_argv: list[str], router_argv: list[str]) -> int:
    dp = DataParallel(n, args, engine_argv, router_argv)
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
    log.info("ready: %d engines behind the router at http://%s:%d", n, args.host, args.port)
    return dp.watch()
