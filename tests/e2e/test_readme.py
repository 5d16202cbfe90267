"""The README's examples run as written, so they cannot rot: every fenced block after a
``<!-- readme-test: KIND -->`` marker runs from the repository root, and must exit 0 and print.

- ``script``: a Python program (the Python API example), run as a file;
- ``shell``: bash, ``.venv/bin/python`` being this interpreter;
- ``server``: bash or Python against the address ``make serve`` gives, here a server of the
  bundled pair started for the test (its port put in place of 8000).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.server import ROOT, Server

pytestmark = pytest.mark.heavy  # minutes of work: started first (tests/conftest.py)

README = os.path.join(ROOT, "README.md")
BLOCK = re.compile(r"<!-- readme-test: (\w+) -->\s*\n```(\w+)\n(.*?)\n```", re.S)
ENV = {**os.environ, "PYTHONPATH": ROOT}


def blocks(kind: str) -> list[tuple[str, str]]:
    """(language, code) of each block marked ``kind``."""
    with open(README) as f:
        return [(lang, code) for k, lang, code in BLOCK.findall(f.read()) if k == kind]


def run(lang: str, code: str, tmp_path) -> subprocess.CompletedProcess:
    code = code.replace(".venv/bin/python", sys.executable)
    if lang == "python":
        path = tmp_path / "example.py"
        path.write_text(code)
        cmd = [sys.executable, str(path)]
    else:
        assert lang == "bash", lang
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip(), f"{code}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr[-3000:]}"
    return out


def test_the_readme_marks_its_examples():
    assert len(blocks("script")) == 1 and len(blocks("shell")) == 1 and len(blocks("server")) >= 3


@pytest.mark.parametrize("kind", ["script", "shell"])
def test_python_api_examples_run(kind, tmp_path):
    for lang, code in blocks(kind):
        run(lang, code, tmp_path)


def test_http_examples_run(tmp_path):
    with Server(None) as srv:  # `make serve`: no model flags, the bundled pair
        for lang, code in blocks("server"):
            code = code.replace("127.0.0.1:8000", f"127.0.0.1:{srv.port}")
            assert str(srv.port) in code
            out = run(lang, code, tmp_path)
            assert "error" not in out.stdout.lower(), out.stdout
