"""Start a real ``tandem router`` process for end-to-end tests, and read its /workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

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


def worker_state(router: str, url: str) -> dict:
    """The router's /workers entry for ``url`` ({} while it is not listed)."""
    return next((w for w in httpx.get(router + "/workers").json()["workers"] if w["url"] == url), {})


def until_breaker_opens(client, model: str, router: str, url: str) -> int:
    """Send small requests until the router opens the breaker of worker ``url``; at most 40.
    Each prompt starts with new random text, so it shares no prefix with earlier ones:
    cache_aware sends an unmatched prompt to the smallest tree, the new worker's."""
    n = 0
    while n < 40 and worker_state(router, url).get("circuit_state") != "open":
        client.completions.create(model=model, prompt=f"{uuid.uuid4().hex} thou art a villain", max_tokens=2)
        n += 1
    return n
