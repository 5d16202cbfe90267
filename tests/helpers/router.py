"""Start a real ``tandem router`` process for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.helpers.server import ROOT, free_port


class RouterProcess:
    def __init__(self, worker_urls: list[str], *extra: str, timeout: float = 30.0, need_healthy: int | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "tandem", "router", "--port", str(self.port), "--log-level", "warning",
                "--worker-urls", *worker_urls, *extra]
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tandem-router-{self.port}.log")
        self.log = open(self.log_path, "w")
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": path})
        try:
            self.wait_healthy(len(worker_urls) if need_healthy is None else need_healthy, timeout)
        except BaseException:
            self.stop()  # nobody else holds it yet: a failed start must not leave a router running
            raise

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/workers", timeout=5.0).json()["workers"]

    def wait_healthy(self, count: int, timeout: float) -> None:
        """Until at least ``count`` workers are in rotation (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if sum(w["is_healthy"] for w in self.workers()) >= count:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"router: {count} healthy workers not reached in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-6000:]

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
