"""deploy/ run for real, without a container engine: the cpu profile of docker-compose.yml as
local processes (two engines on the bundled pair and the router), installed by replaying the
Dockerfile's cpu target in a fresh virtualenv and started with the image's ENTRYPOINT and the
compose commands, scraped by a real Prometheus started from deploy/prometheus/prometheus.yml.
After a workload through the router, every query of the Grafana dashboard returns data and every
alert rule evaluates; two alerts are driven into `pending` on purpose.

Needs the `prometheus` binary (Debian package; `make test` installs it as root). Outside CI a
machine without it skips this module; in CI (CI=true) that is a failure.
Set TANDEM_DEPLOY_TEST_VENV=DIR to reuse a venv built by an earlier run (local iteration only).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import re
import shutil
import subprocess
import time

import httpx
import pytest
from openai import OpenAI

from tests.helpers.deploy_stack import (DEPLOY, FreshVenv, Prometheus, Proc, compose_config,
                                        dashboard_targets, find_alert, grafana_expr, live_series, localize, scalar,
                                        wait_until)
from tests.helpers.fake_upstream import FakeEngine, ServerThread
from tests.helpers.router import until_breaker_opens, worker_state
from tests.helpers.server import ROOT, free_port

pytestmark = pytest.mark.heavy  # minutes of work: started first (tests/conftest.py)
# An engine's first start on a fresh machine builds the CPU programs before /health answers:
# ~3 min alone on a fast 2-core VM, over 6 min on a slow one with the other test process building
# too (the bundled pair's e2e test allows the same).
FIRST_BUILD_S = 900

DASHBOARD = os.path.join(DEPLOY, "grafana", "dashboards", "tandem.json")
ENGINES = ("engine-0-cpu", "engine-1-cpu")
RATE_WINDOW = "4s"
N_REQUESTS = 48  # x 48 tokens, 8 at a time: a few seconds of work, several scrapes long  # Grafana's $__rate_interval for a 1 s scrape interval: 4 x scrape

# (panel title, refId) -> why the query may return only zeros in this workload. Every other
# query must return a finite value > 0 at some point of the workload.
ZERO_OK = {
    ("Errors", "A"): "no request fails on an engine in this workload",
    ("Errors", "B"): "the fake worker's 503s are retried, so the router answers every request 200",
    ("Errors", "C"): "no engine refuses a request at admission at this load",
    ("Preemptions", "A"): "the bundled pair's KV pool never runs out at this load",
    ("Running / waiting requests", "B"): "the queue may stay empty: each engine admits the whole batch",
    ("Retries", "B"): "retries never run out: two healthy engines take every retried request",
    ("Engine restarts", "A"): "no engine dies in this workload",
}


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """The cpu image, as a fresh venv built by the Dockerfile's own steps."""
    prom_bin = shutil.which("prometheus")
    if prom_bin is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed: `make test` installs it (apt, as root)")
        pytest.skip("prometheus not installed (make test installs Debian's package as root)")
    tmp = str(tmp_path_factory.mktemp("deploy-image"))
    t0 = time.monotonic()
    reuse = os.environ.get("TANDEM_DEPLOY_TEST_VENV")
    venv = FreshVenv(reuse or tmp, "cpu") if not (reuse and os.path.isdir(os.path.join(reuse, "venv"))) \
        else _reused(reuse)
    workdir = os.path.join(tmp, "home")  # like the image's WORKDIR: not the checkout
    os.makedirs(workdir, exist_ok=True)
    return {"venv": venv, "install_s": time.monotonic() - t0, "prometheus": prom_bin, "workdir": workdir,
            "tmp": tmp}


@pytest.fixture(scope="module")
def stack(image, tmp_path_factory):
    venv, prom_bin, workdir = image["venv"], image["prometheus"], image["workdir"]
    tmp = str(tmp_path_factory.mktemp("deploy-stack"))
    cfg = compose_config("cpu")
    services = cfg["services"]
    ports = {name: free_port() for name in (*ENGINES, "router")}
    hosts = {}  # every compose name or alias an engine answers to -> its local port
    for name in ENGINES:
        hosts[name] = ports[name]
        for alias in (services[name].get("networks", {}).get("default") or {}).get("aliases", []):
            hosts[alias] = ports[name]
    procs: dict[str, Proc] = {}
    fake_threads: list[ServerThread] = []
    prom = None
    try:
        for name in ENGINES:
            argv = localize(venv.entrypoint + services[name]["command"], ports[name], hosts)
            procs[name] = Proc(name, argv, venv.env(), workdir, tmp)
        for name in ENGINES:
            _wait_healthy(venv, services[name], procs[name], ports[name], timeout=FIRST_BUILD_S)
        router_argv = localize(venv.entrypoint + services["router"]["command"], ports["router"], hosts)
        procs["router"] = Proc("router", router_argv, venv.env(), workdir, tmp)
        _wait_healthy(venv, services["router"], procs["router"], ports["router"], timeout=60)
        router_url = f"http://127.0.0.1:{ports['router']}"
        wait_until(lambda: httpx.get(router_url + "/workers").json()["healthy"] == 2, 30,
                   "router sees both engines healthy", procs["router"])
        targets = {"engine-0:8000": f"127.0.0.1:{hosts['engine-0']}",
                   "engine-1:8000": f"127.0.0.1:{hosts['engine-1']}",
                   "router:8000": f"127.0.0.1:{ports['router']}"}
        prom = Prometheus(tmp, targets, prom_bin)
        # A third worker that is healthy but answers every generation with 503: the router
        # retries its requests on the real engines and opens its circuit (Retries, Circuit panels).
        fakes = [FakeEngine("tiny-shakespeare"), FakeEngine("tiny-shakespeare")]
        for fake in fakes:
            fake.status = 503
        fake_threads = [ServerThread(f.app) for f in fakes]
        yield {"venv": venv, "procs": procs, "router": router_url, "prom": prom,
               "fake_url": fake_threads[0].url, "fake2_url": fake_threads[1].url, "ports": ports, "hosts": hosts,
               "compose": services}
    finally:
        for p in procs.values():
            p.stop()
        if prom is not None:
            prom.stop()
        for t in fake_threads:
            t.stop()


def _reused(root: str) -> FreshVenv:
    v = FreshVenv.__new__(FreshVenv)
    v.root, v.venv = root, os.path.join(root, "venv")
    from tests.helpers.deploy_stack import dockerfile_stages
    v.final = dockerfile_stages()[1]["cpu"]
    v.entrypoint, v.cmd, v.healthcheck = v._exec_form("ENTRYPOINT"), v._exec_form("CMD"), v._exec_form("HEALTHCHECK")
    v.log, v.skipped = ["reused " + root], []
    return v


def _wait_healthy(venv: FreshVenv, service: dict, proc: Proc, port: int, timeout: float) -> None:
    """Healthy as the image and compose judge it: their own healthcheck commands exit 0."""
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD", test
    compose_check = [w.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for w in test[1:]]
    image_check = venv.healthcheck  # HEALTHCHECK CMD: default URL, port from the environment
    env = venv.env(TANDEM_HEALTH_URL=f"http://127.0.0.1:{port}/health")

    def ok() -> bool:
        return subprocess.run(compose_check, env=env, capture_output=True, timeout=10).returncode == 0

    wait_until(ok, timeout, f"{proc.name} healthcheck {compose_check}", proc, interval=0.5)
    if service["command"][0] == "serve":
        assert subprocess.run(image_check, env=env, capture_output=True, timeout=10).returncode == 0


@pytest.fixture(scope="module")
def workload(stack):
    """Shared-prefix completions, chats and streams through the router, 8 at a time, on the
    compose topology alone (the plain phase); then failing workers for the retry and circuit panels."""
    fake_url = stack["fake_url"]
    client = OpenAI(base_url=stack["router"] + "/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    systems = [f"{name}: " + ("Now is the winter of our discontent made glorious summer by this sun of "
                              "York; and all the clouds that lour'd upon our house in the deep bosom "
                              "of the ocean buried. ") * 3 for name in ("KING", "QUEEN", "ROMEO", "JULIET")]

    def one(i: int) -> int:
        prompt = systems[i % 4] + f"Question {i}: what say you?"
        kw = {"model": model, "max_tokens": 48, "extra_body": {"ignore_eos": True}}
        if i % 3 == 0:
            return client.completions.create(prompt=prompt, temperature=0, **kw).usage.completion_tokens
        if i % 3 == 1:
            n = 0
            for chunk in client.completions.create(prompt=prompt, stream=True,
                                                   stream_options={"include_usage": True}, **kw):
                n = chunk.usage.completion_tokens if chunk.usage else n
            return n
        return client.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                              **kw).usage.completion_tokens

    # rate() needs a sample from before the workload: wait for two scrapes of every target.
    wait_until(lambda: scalar(stack["prom"], "min(count_over_time(up[1m]))") >= 2, 40, "two scrapes of each target")
    t0 = time.time()
    with cf.ThreadPoolExecutor(8) as pool:
        tokens = list(pool.map(one, range(N_REQUESTS)))
    assert tokens == [48] * N_REQUESTS
    prom = stack["prom"]
    wait_until(lambda: scalar(prom, "sum(tandem:request_success_total)") >= N_REQUESTS, 60,
               f"prometheus scraped the plain phase's {N_REQUESTS} finished requests")
    time.sleep(2)
    plain_end = time.time()
    r = httpx.post(stack["router"] + "/workers", json={"url": fake_url}, timeout=10)
    assert r.status_code in (200, 201), r.text
    wait_until(lambda: worker_state(stack["router"], fake_url).get("is_healthy"), 20, "router admits the fake worker")
    # Keep sending small requests until the fake worker's breaker opens (bounded).
    extra = until_breaker_opens(client, model, stack["router"], fake_url)
    # The router creates tandem_router_retries_total{route} at the first retry, so rate() cannot
    # see the retries that created it: once Prometheus has the series, a second failing worker
    # makes retries that the Retries panel must show.
    wait_until(lambda: prom.query("tandem_router_retries_total"), 30, "retries counter scraped")
    time.sleep(1.5)
    second = stack["fake2_url"]
    assert httpx.post(stack["router"] + "/workers", json={"url": second}, timeout=10).status_code in (200, 201)
    wait_until(lambda: worker_state(stack["router"], second).get("is_healthy"), 20, "router admits the second fake")
    extra += until_breaker_opens(client, model, stack["router"], second)
    t1 = time.time()
    n = N_REQUESTS + extra
    wait_until(lambda: scalar(prom, "sum(tandem:request_success_total)") >= n, 60,
               f"prometheus scraped {n} finished requests")
    time.sleep(2)  # two more scrapes: the rate windows see the workload's tail
    return {"start": t0 - 2, "end": time.time(), "plain_end": plain_end, "requests": n, "tokens": tokens,
            "extra": extra, "t1": t1, "model": model}


def test_the_image_steps_install_and_its_default_command_serves(image):
    """`docker run -p 8000:8000 tandem:cpu`: ENTRYPOINT + CMD with no volume serve the bundled
    pair, the HEALTHCHECK command turns healthy, and SIGTERM (docker stop) exits 0."""
    venv = image["venv"]
    print(f"fresh venv in {image['install_s']:.0f}s:", *venv.log, "skipped:", *venv.skipped, sep="\n  ")
    if not venv.log[0].startswith("reused"):
        assert any("torch==2.13.0" in line for line in venv.log)
        assert any("pip install -e " in line for line in venv.log)
    assert venv.entrypoint == ["tandem"] and venv.cmd[0] == "serve"
    port = free_port()
    proc = Proc("image-default", localize(venv.entrypoint + venv.cmd, port, {}), venv.env(), image["workdir"],
                image["tmp"])
    try:
        env = venv.env(TANDEM_HEALTH_URL=f"http://127.0.0.1:{port}/health")
        wait_until(lambda: subprocess.run(venv.healthcheck, env=env, capture_output=True, timeout=10).returncode == 0,
                   FIRST_BUILD_S, "the image's HEALTHCHECK", proc, interval=0.5)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        assert model == "tiny-shakespeare"
        out = client.completions.create(model=model, prompt="ROMEO:", max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8 and out.choices[0].text
        info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=10).json()
        # The bundled pair, found next to the installed sources (the image's /opt/tandem), with MTP.
        assert info["model_path"] == os.path.join(ROOT, "models", "tiny-shakespeare", "target")
        assert info["speculative_algorithm"] == "FROZEN-KV-MTP"
    finally:
        rc = proc.stop(40)
    assert rc == 0, proc.output()
    with open(proc.log_path) as f:
        assert "decode graphs compiled for the CPU" in f.read()  # the worker's ready line


def test_the_stack_is_up(stack):
    for name in ("engine-0-cpu", "engine-1-cpu", "router"):
        assert stack["procs"][name].alive(), stack["procs"][name].output()
    info = httpx.get(f"{stack['router']}/v1/models").json()
    assert [m["id"] for m in info["data"]] == ["tiny-shakespeare"]


def test_healthcheck_reports_a_dead_endpoint(stack):
    env = stack["venv"].env(TANDEM_HEALTH_URL=f"http://127.0.0.1:{free_port()}/health")
    assert subprocess.run(stack["venv"].healthcheck, env=env, capture_output=True, timeout=10).returncode == 1


def test_every_target_is_scraped(stack, workload):
    active = stack["prom"].get("targets")["activeTargets"]
    by_job = {}
    for t in active:
        assert t["health"] == "up", (t["scrapeUrl"], t["lastError"])
        by_job.setdefault(t["labels"]["job"], []).append(t["labels"])
    assert sorted(lbl["engine"] for lbl in by_job["tandem-engine"]) == ["engine-0", "engine-1"]
    assert len(by_job["tandem-router"]) == 1


def test_dashboard_variables_resolve(stack, workload):
    with open(DASHBOARD) as f:
        variables = json.load(f)["templating"]["list"]
    for var in variables:
        m = re.fullmatch(r"label_values\(([^,]+),\s*(\w+)\)", var["query"]["query"])
        assert m, var["query"]
        values = stack["prom"].get(f"label/{m.group(2)}/values", **{"match[]": m.group(1)})
        assert values, f"variable {var['name']}: no values"
        if var["name"] == "engine":
            assert sorted(values) == ["engine-0", "engine-1"]
        if var["name"] == "model_name":
            assert values == [workload["model"]]


def test_every_dashboard_query_returns_data(stack, workload):
    prom = stack["prom"]
    failures, zeros, report = [], [], []
    for title, ref, expr in dashboard_targets(DASHBOARD):
        series = prom.query_range(grafana_expr(expr, RATE_WINDOW), workload["start"], workload["end"])
        values = [float(v) for s in series for _, v in s["values"]]
        finite = [v for v in values if math.isfinite(v)]
        key = (title, ref)
        report.append(f"{title}/{ref}: {len(series)} series, max {max(finite) if finite else None}")
        if not series:
            failures.append(f"{title} [{ref}] returned no series: {expr}")
        elif not finite:
            failures.append(f"{title} [{ref}] returned only NaN/Inf: {expr}")
        elif max(finite) <= 0 and key not in ZERO_OK:
            failures.append(f"{title} [{ref}] stayed at {max(finite)}: {expr}")
        elif max(finite) <= 0:
            zeros.append(f"{title} [{ref}]: 0 ({ZERO_OK[key]})")
    print("\n".join(report + ["zero, allowed:"] + zeros))
    assert not failures, "\n".join(failures)


def test_every_dashboard_query_has_data_on_the_plain_topology(stack, workload):
    """What a user of the cpu profile sees after a few requests, with nothing failing: no panel
    says "No data" (a counter the code creates on its first event reads 0, not absent)."""
    prom = stack["prom"]
    empty = []
    for title, ref, expr in dashboard_targets(DASHBOARD):
        series = prom.query_range(grafana_expr(expr, RATE_WINDOW), workload["start"], workload["plain_end"])
        if not any(math.isfinite(float(v)) for s in series for _, v in s["values"]):
            empty.append(f"{title} [{ref}]: {expr}")
    assert not empty, "panels with no data on the plain topology:\n" + "\n".join(empty)


# Series created on their first event; none happens in this workload (the router's per-route
# counters are created at start-up, so none of theirs is here).
CREATED_ON_FIRST_EVENT: dict[str, str] = {}
# Labels that Prometheus adds to every scraped series (prometheus.yml's target labels).
TARGET_LABELS = {"job", "instance", "engine", "router", "__name__", "le"}


def test_every_series_and_label_in_deploy_is_on_the_live_metrics_pages(stack, workload):
    """The names (with their _total / _bucket suffixes) and label matchers of every dashboard
    query and alert rule, against what the live engines and router serve on /metrics."""
    import yaml

    live: dict[str, set[str]] = {}
    for name in ("engine-0-cpu", "router"):
        text = httpx.get(f"http://127.0.0.1:{stack['ports'][name]}/metrics", timeout=10).text
        for k, v in live_series(text).items():
            live.setdefault(k, set()).update(v)
    with open(os.path.join(DEPLOY, "prometheus", "alerts.yml")) as f:
        rules = [r["expr"] for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    missing = []
    for expr in [e for _, _, e in dashboard_targets(DASHBOARD)] + rules:
        for m in re.finditer(r"\b(tandem:[a-z0-9_]+|tandem_router_[a-z0-9_]+)(\{[^}]*\})?", expr):
            name, matchers = m.group(1), m.group(2) or ""
            if name not in live:
                if name not in CREATED_ON_FIRST_EVENT:
                    missing.append(f"{name} (in {expr})")
                continue
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
                if label not in live[name] | TARGET_LABELS:
                    missing.append(f"{name} has no label {label!r} (in {expr})")
    assert not missing, "\n".join(missing)


def test_spec_decode_and_prefix_cache_are_real(stack, workload):
    prom = stack["prom"]
    w = "[5m]"
    accept_len = scalar(prom, f"1 + sum(increase(tandem:spec_decode_num_accepted_tokens_total{w})) / "
                               f"sum(increase(tandem:spec_decode_num_drafts_total{w}))")
    assert 1.0 < accept_len <= 4.0, accept_len  # bundled pair: 3 draft steps, so 1..4 tokens a step
    positions = prom.query("sum by (position) (tandem:spec_decode_num_accepted_tokens_per_pos_total)")
    assert sorted(s["metric"]["position"] for s in positions) == ["0", "1", "2"]
    hit = scalar(prom, "sum(tandem:prefix_cache_hits_total) / sum(tandem:prefix_cache_queries_total)")
    assert hit > 0.3, f"shared system prompts should hit the prefix cache, got {hit}"
    # The router's per-engine view matches what the engines served.
    served = prom.query("sum by (worker) (tandem_router_worker_requests_total{outcome=\"ok\"})")
    assert len([s for s in served if float(s["value"][1]) > 0]) == 2, served


def test_every_alert_rule_evaluates(stack, workload):
    prom = stack["prom"]
    groups = wait_until(lambda: (g := prom.get("rules")["groups"]) and all(
        r.get("lastEvaluation", "").startswith("20") for grp in g for r in grp["rules"]) and g, 15,
        "every rule evaluated once")
    names = []
    for grp in groups:
        for rule in grp["rules"]:
            names.append(rule["name"])
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
            prom.query(rule["query"])  # raises on an evaluation error
    with open(os.path.join(DEPLOY, "prometheus", "alerts.yml")) as f:
        import yaml
        shipped = [r["alert"] for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    assert sorted(names) == sorted(shipped)


def test_circuit_open_alert_goes_pending_for_the_failing_workers(stack, workload):
    prom, fakes = stack["prom"], (stack["fake_url"], stack["fake2_url"])
    # Each fake's breaker opened during the workload (it half-opens again 30 s later, so the
    # test reads Prometheus' history, not the current state): the rule's series and its
    # ALERTS{alertstate="pending"} series (Prometheus records them) both show it.
    for url in fakes:
        assert scalar(prom, f'max_over_time(tandem_router_worker_cb_state{{worker="{url}"}}[5m])') == 1, url
    pending = 'max_over_time(ALERTS{alertname="TandemCircuitOpen",alertstate="pending"}[5m])'
    series = wait_until(lambda: len(r := prom.query(pending)) == 2 and r, 15, "TandemCircuitOpen went pending")
    assert sorted(s["metric"]["worker"] for s in series) == sorted(fakes)
    assert all(s["metric"]["severity"] == "warning" for s in series)


def test_engine_down_alert_goes_pending_when_an_engine_stops(stack, workload):
    # Last test of the module: it stops engine-1 (SIGTERM: the engine drains and exits 0).
    rc = stack["procs"]["engine-1-cpu"].stop(40)
    assert rc == 0, stack["procs"]["engine-1-cpu"].output()
    alert = wait_until(lambda: find_alert(stack["prom"], "TandemEngineDown"), 30, "TandemEngineDown pending")
    assert alert["labels"]["engine"] == "engine-1" and alert["labels"]["severity"] == "critical"
    assert find_alert(stack["prom"], "TandemRouterDown") is None
