"""deploy/k8s/ validated offline: core objects against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields fail), the Prometheus Operator objects against
models generated from the monitoring.coreos.com CRD schemas (cloudcoil-models-prometheus-operator;
a field the CRD does not know would be pruned by the API server, so the test fails on any),
then the references between them: selectors, ports, probes, flags, drain time, labels."""

from __future__ import annotations

import glob
import os
import re

import kubernetes_validate
import pytest
import yaml

from tests.helpers.deploy_stack import DEPLOY

K8S = os.path.join(DEPLOY, "k8s")
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())  # oldest supported upstream .. newest


def _docs() -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
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
    with open(os.path.join(K8S, "kustomization.yaml")) as f:
        listed = yaml.safe_load(f)["resources"]
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(K8S, "*.yaml")))
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
    from proto.args import build_parser
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
