"""The scheduler process's loop (``scheduler_proc/main.py``) around the core: what it does on
Shutdown."""

from __future__ import annotations

from types import SimpleNamespace

import scheduler_proc.main as sched_main
from proto.messages import Shutdown


def test_shutdown_is_forwarded_and_ends_the_loop_before_another_poll(monkeypatch):
    """The Shutdown the front sends is passed on to the worker and the loop ends at once: one
    more pass would plan, flush and then sit in the poll for up to a second, which every server
    stop used to wait out."""
    loop = sched_main.SchedulerLoop.__new__(sched_main.SchedulerLoop)
    loop.running = True
    loop.requests, loop.results = SimpleNamespace(sock="requests"), SimpleNamespace(sock="results")
    forwarded, polls, inbox = [], [], [Shutdown("front shutting down")]
    loop.plans = SimpleNamespace(send=forwarded.append)
    loop._recv = lambda chan: inbox.pop(0) if chan is loop.requests and inbox else None
    loop.core = SimpleNamespace(inflight=[], counters=SimpleNamespace(busy_s=0.0))
    loop.depth = 2
    loop.planner = SimpleNamespace(plan=lambda: None)
    loop._flush_outputs = lambda: True  # a change left to report: the poll would wait 50 ms at least

    class Poller:
        def register(self, *_):
            pass

        def poll(self, timeout):
            polls.append(timeout)
            loop.running = False  # a loop that polls still ends, but the test has seen it
            return {}

    monkeypatch.setattr(sched_main.zmq, "Poller", Poller)
    loop.run()
    assert forwarded == [Shutdown("front shutting down")]
    assert polls == []
