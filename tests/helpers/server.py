"""Start a real ``tandem serve`` (three processes) for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_then_leave(url: str, path: str, body: dict, until, timeout: float = 15.0) -> None:
    """A client that goes away: POST ``body`` to ``url + path`` (HTTP/1.1 on a plain socket),
    wait until ``until()`` says the server took the request (bounded), then close without
    reading an answer. Unlike a short client timeout, this cannot leave before a slow (loaded)
    server even received the request."""
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(head + data)
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, f"{url}{path}: the server never took the request"
            time.sleep(0.01)


class Server:
    """``compiled``: on the CPU, decode steps run the compiled programs, as by default (the first
    server of a model shape builds them: a minute or two more to ready); otherwise the server
    runs with ``--disable-cuda-graph``."""

    def __init__(self, model_path: str | None, *extra: str, timeout: float = 180.0, env: dict | None = None,
                 device: str = "cpu", port: int | None = None, wait: bool = True, compiled: bool = False):
        self.port = port or free_port()
        args = [sys.executable, "-m", "tandem", "serve", "--device", device, "--port", str(self.port),
                "--num-threads", "1", "--log-level", "warning"]
        if device == "cpu" and not compiled:
            args.append("--disable-cuda-graph")
        if model_path:
            args += ["--model-path", model_path]
        args += list(extra)
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tandem-server-{self.port}.log")
        self.log = open(self.log_path, "w")
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
        full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=full_env)
        self.url = f"http://127.0.0.1:{self.port}"
        self.timeout = timeout
        if wait:
            self._wait_ready(timeout)

    def wait_ready(self) -> "Server":
        """For ``wait=False``: start several servers at once, then wait for each."""
        self._wait_ready(self.timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-6000:]

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
