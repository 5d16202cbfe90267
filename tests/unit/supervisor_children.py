"""Stand-in children for tests/unit/tandem/test_supervisor.py (a light module: spawn imports it).

Front: reports ready and idles until SIGTERM (or exits 0 after 0.3 s with
TANDEM_TEST_FRONT_EXIT0, as a front that drained by itself). Engine roles named in
TANDEM_TEST_CRASH die with code 3 0.2 s after the front reported ready (a death after start-up,
however slowly the children spawn: the front leaves a flag file in the run dir); the others idle."""

from __future__ import annotations

import os
import time


def _ready_flag(endpoints) -> str:
    return os.path.join(os.path.dirname(endpoints.requests.removeprefix("ipc://")), "front-ready")


def fake_child(role, args, endpoints, status_conn, parent_pid=None, **worker_kw):
    crash = os.environ.get("TANDEM_TEST_CRASH", "worker").split(",")
    if role == "tokenizer":
        status_conn.send(("ready", None))
        open(_ready_flag(endpoints), "w").close()
        if os.environ.get("TANDEM_TEST_FRONT_EXIT0"):
            time.sleep(0.3)
            os._exit(0)
    if role in crash:
        deadline = time.monotonic() + 60
        while not os.path.exists(_ready_flag(endpoints)) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        os._exit(3)
    while True:
        time.sleep(0.1)
