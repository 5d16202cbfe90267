"""Stand-in children for tests/unit/test_supervisor.py (a light module: spawn imports it).

Front: reports ready and idles until SIGTERM (or exits 0 after 0.3 s with
TANDEM_TEST_FRONT_EXIT0, as a front that drained by itself). Engine roles named in
TANDEM_TEST_CRASH die with code 3 after 0.2 s; the others idle."""

from __future__ import annotations

import os
import time


def fake_child(role, args, endpoints, status_conn, parent_pid=None, **worker_kw):
    crash = os.environ.get("TANDEM_TEST_CRASH", "worker").split(",")
    if role == "tokenizer":
        status_conn.send(("ready", None))
        if os.environ.get("TANDEM_TEST_FRONT_EXIT0"):
            time.sleep(0.3)
            os._exit(0)
    if role in crash:
        time.sleep(0.2)
        os._exit(3)
    while True:
        time.sleep(0.1)
