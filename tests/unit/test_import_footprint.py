"""What each light process leaves out of its imports, each module a few MB resident
(docs/decisions/cpu.md, "Memory"): the supervisor loads no asyncio, numpy, urllib.request or
importlib.metadata; the scheduler no asyncio; the front no numpy. Each set is read in a fresh
interpreter, as the process would start."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.server import ROOT

SUPERVISOR = ("import tandem.cli, tandem.dp, tandem.supervisor\n"
              "from common.serve_cli import parse_server_args\n"
              "parse_server_args([])\n")
CHILD = "import tandem.launch, tandem.child, common.args, proto.transport\n"


@pytest.mark.parametrize("code,absent", [
    (SUPERVISOR, ("asyncio", "numpy", "urllib.request", "importlib.metadata", "multiprocessing.resource_tracker")),
    (CHILD + "import scheduler_proc.main\n", ("asyncio", "zmq.asyncio", "zmq.auth.thread")),
    (CHILD + "import tokenizer_proc.main\n", ("numpy",)),
], ids=["supervisor", "scheduler", "front"])
def test_light_processes_leave_heavy_modules_out(code, absent):
    probe = code + f"import sys\nprint(sorted(m for m in {absent!r} if m in sys.modules))\n"
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"
