#!/usr/bin/env python3
"""Writes base/prometheusrule.yaml: deploy/prometheus/alerts.yml as a Prometheus Operator PrometheusRule.

alerts.yml stays the one source of the rules (compose mounts it; promtool tests it); the unit
test fails when this file has drifted from it.   python deploy/k8s/make_prometheusrule.py [--check]
"""

from __future__ import annotations

import os
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "prometheus", "alerts.yml")
OUT = os.path.join(HERE, "base", "prometheusrule.yaml")
HEADER = "# Generated from deploy/prometheus/alerts.yml by make_prometheusrule.py; edit that file.\n"


def render() -> str:
    with open(SRC) as f:
        groups = yaml.safe_load(f)["groups"]
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "tandem", "labels": {"app.kubernetes.io/name": "tandem",
                                                  "app.kubernetes.io/part-of": "tandem"}},
        "spec": {"groups": groups},
    }
    return HEADER + yaml.safe_dump(doc, sort_keys=False, width=100)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        with open(OUT) as f:
            stale = f.read() != text
        if stale:
            print(f"{OUT} is stale: run python deploy/k8s/make_prometheusrule.py", file=sys.stderr)
        return 1 if stale else 0
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
