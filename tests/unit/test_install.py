"""`make serve` installs the runtime only, quietly; `make test` adds the dev extra. The package
metadata builds without a setuptools warning (they filled a screen on every install)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.helpers.server import ROOT


def _dry_run(target: str, venv: str) -> list[str]:
    out = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if " pip install " in line]


def test_make_serve_installs_the_runtime_only_and_quietly(tmp_path):
    venv = str(tmp_path / "fresh-venv")
    serve = _dry_run("serve", venv)
    assert serve and all(" -q " in line for line in serve)
    assert any(line.endswith(" -e .") for line in serve) and not any("[dev]" in line for line in serve)
    test = _dry_run("test", venv)
    assert any("'.[dev]'" in line for line in test) and all(" -q " in line for line in test)


def test_package_metadata_builds_without_setuptools_warnings(tmp_path):
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    code = ("import warnings, setuptools.build_meta as b\n"
            "warnings.simplefilter('error')\n"
            "b.prepare_metadata_for_build_wheel('meta')\n")
    (tmp_path / "meta").mkdir()
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Warning" not in run.stderr


def test_every_data_file_of_a_package_is_in_its_package_data():
    """A wheel (non-editable install) carries only what ``package-data`` names beside the Python
    modules: every other tracked file inside a package (the MoE launch shapes, the CPU steps'
    GEMM source) must match a pattern there, or an installed engine misses it at run time."""
    import fnmatch
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        cfg = tomllib.load(f)["tool"]["setuptools"]
    data = cfg["package-data"]
    roots = [p.rstrip("*") for p in cfg["packages"]["find"]["include"]]
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    inside = [f for f in files if f.split("/")[0] in roots and "/" in f and not f.endswith(".py")]
    assert inside, "no data files found: the check would pass vacuously"

    def listed(path: str) -> bool:
        patterns = data.get(os.path.dirname(path).replace("/", "."), [])
        return any(fnmatch.fnmatch(os.path.basename(path), pat) for pat in patterns)

    missing = [f for f in inside if not listed(f)]
    assert not missing, missing
