"""The benchmark scripts a GPU run starts from: the wheel list parses as requirements, and the
suite script is valid shell."""

from __future__ import annotations

import pathlib
import subprocess

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_fetch_gpu_wheels_lists_valid_requirements():
    out = subprocess.run(["bash", "benchmarks/fetch_gpu_wheels.sh", "--list"], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=60).stdout.split("\n")
    reqs = [line for line in out if line]
    assert len(reqs) > 10
    names = {Requirement(r).name for r in reqs}  # an inline comment left in would not parse
    assert {"msgspec", "xgrammar", "openai"} <= names
    assert all("#" not in r and r == r.strip() for r in reqs)


def test_suite_scripts_are_valid_shell():
    for script in ("gpu_suite.sh", "fetch_gpu_wheels.sh", "cpu_suite.sh", "lab/ab_base.sh"):
        subprocess.run(["bash", "-n", f"benchmarks/{script}"], cwd=ROOT, check=True, timeout=30)
