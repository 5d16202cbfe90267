"""The worker's loop (``Worker.run``) against fake plans, steps and results: how many steps it
keeps launched (``--overlap-depth``), that it launches the next plan instead of waiting on a step
it need not wait for, and the order a constrained (structured-output) step retires the others."""

from __future__ import annotations

import pytest


def _worker_loop(depth: int, recv, ready=lambda step, done, log: done, sync_plans=()) -> tuple[list, list]:
    """``Worker.run`` against fakes: ``recv(timeout_ms, log, sent)`` answers the plan socket,
    ``ready(step, waited, log)`` says whether a step's copy has landed; ``sync_plans``: step ids
    whose plans need every step in flight returned first. -> (log of ("launch", step)
    and ("wait", step, finished when waited for), step ids of the results sent)."""
    from gpu_worker.main import Worker
    from gpu_worker.settings import DevSettings
    from proto.messages import StepResult

    log, sent = [], []

    class Pending:
        def __init__(self, step):
            self.step, self.done = step, False

        def ready(self):
            return ready(self.step, self.done, log)

        def result(self):
            log.append(("wait", self.step, self.ready()))
            self.done = True
            return StepResult(self.step, b"", b"", b"")

    class Runner:
        settings = DevSettings()

        def launch(self, plan, retire=None):
            log.append(("launch", plan.step_id))
            if plan.step_id in sync_plans:  # structured output: its masks need the steps in flight
                retire()
                log.append(("masked", plan.step_id))
            return Pending(plan.step_id)

    class Plans:
        def recv(self, timeout_ms=None):
            return recv(timeout_ms, log, sent)

    class Results:
        def send(self, msg):
            sent.append(msg.step_id)

    w = Worker.__new__(Worker)
    w.plans, w.results, w.runner, w.depth = Plans(), Results(), Runner(), depth
    w.run()
    return log, sent


def _first(log, entry) -> int:
    return next(i for i, e in enumerate(log) if e[:len(entry)] == entry)


def test_worker_launches_the_next_plan_before_waiting_on_a_lone_unfinished_step():
    """The scheduler sends plan N+2 only after it has processed result N, i.e. a moment after
    the worker sent it. The worker checks for a plan with timeout 0, finds none and then waits
    on step N+1's event (``plan is None`` forces the send): the device drains N+1 and idles
    while N+2 is received and launched. It should wait for a plan *or* the event instead."""
    from proto.messages import Shutdown, StepPlan

    queue = [StepPlan(1), StepPlan(2)]

    def recv(timeout_ms, log, sent):  # plans 1 and 2 are queued; plan 3 arrives just after result 1
        if queue:
            return queue.pop(0)
        if sent and timeout_ms != 0 and ("launch", 3) not in log:
            return StepPlan(3)
        return None if timeout_ms == 0 else Shutdown("test")

    log, _ = _worker_loop(2, recv)
    # Step 2 must not be waited for (its copy not done) before plan 3 is launched behind it.
    assert _first(log, ("launch", 3)) < _first(log, ("wait", 2)), log


@pytest.mark.parametrize("depth", [2, 3])
def test_worker_keeps_depth_steps_launched(depth):
    """With plans queued and no step finished, the worker launches ``depth`` steps before it
    waits on the oldest (``--overlap-depth``), then one more per result sent, in order."""
    from proto.messages import Shutdown, StepPlan

    queue = [StepPlan(i) for i in range(1, 6)] + [Shutdown("test")]
    log, sent = _worker_loop(depth, lambda timeout_ms, log, sent: queue.pop(0))
    assert [e[:2] for e in log[:depth + 1]] == [("launch", i) for i in range(1, depth + 1)] + [("wait", 1)], log
    assert log[depth + 1] == ("launch", depth + 1), log  # one more launched per result sent
    assert sent == [1, 2, 3, 4, 5]


def test_worker_without_a_plan_sends_the_done_step_but_does_not_drain():
    """Depth 3, steps 2 (done) and 3 (running) in flight, no plan yet: the worker sends result 2
    and goes back to waiting for a plan *or* step 3; plan 4 arrives and is launched before step
    3 is waited for (draining every step in flight would idle the device behind the host)."""
    from proto.messages import Shutdown, StepPlan

    queue, polls = [StepPlan(1), StepPlan(2), StepPlan(3)], []

    def recv(timeout_ms, log, sent):
        if queue:
            return queue.pop(0)
        if 2 not in sent:  # plan 4 is on its way only once result 2 is out
            polls.append(timeout_ms)
            return None
        return StepPlan(4) if ("launch", 4) not in log else Shutdown("test")

    def ready(step, done, log):
        if step == 1:
            return ("launch", 3) in log
        if step == 2:
            return len(polls) >= 2  # done while the worker polls for plan 4
        return done

    log, _ = _worker_loop(3, recv, ready)
    assert _first(log, ("launch", 4)) < _first(log, ("wait", 3)), log
    assert all(e[2] for e in log if e[0] == "wait" and e[1] in (1, 2)), log  # never blocked on them


def test_a_constrained_step_retires_the_steps_in_flight_before_its_masks():
    """Structured output: step 4 samples for a grammar row. Its launch queues the forward, then
    (``retire``) steps 2 and 3 return and their results go out, then the masks are built; the
    steps after it keep the overlap."""
    from proto.messages import Shutdown, StepPlan

    queue = [StepPlan(i) for i in range(1, 7)]

    def recv(timeout_ms, log, sent):
        return queue.pop(0) if queue else Shutdown("test")

    log, sent = _worker_loop(3, recv, sync_plans=(4,))
    assert sent == [1, 2, 3, 4, 5, 6]
    launch4 = _first(log, ("launch", 4))
    assert launch4 < _first(log, ("wait", 2)) < _first(log, ("wait", 3)) < _first(log, ("masked", 4)), log
    assert _first(log, ("launch", 6)) < _first(log, ("wait", 5)), log  # overlap again after it
