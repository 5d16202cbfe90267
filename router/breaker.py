"""Per-worker circuit breaker: closed -> open -> half-open -> closed (SGLang's semantics).

closed:    requests flow; ``failure_threshold`` failures within ``window_s`` open it.
open:      no requests; after ``timeout_s`` the next ``allow()`` moves it to half-open.
half-open: trial requests flow; ``success_threshold`` successes in a row close it, one
           failure opens it again (and restarts the timeout).
The clock is injected so tests drive time; nothing here sleeps or does I/O.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from router.config import BreakerConfig

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_CODE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}  # the smg_worker_cb_state encoding


class CircuitBreaker:
    def __init__(self, cfg: BreakerConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self._clock = clock
        self.state = CLOSED
        self._failures: deque[float] = deque()
        self._successes = 0
        self._opened_at = 0.0
        self.transitions = 0

    def allow(self) -> bool:
        """May a request go to this worker now? (open -> half-open happens here.)"""
        if not self.cfg.enabled:
            return True
        if self.state == OPEN and self._clock() - self._opened_at >= self.cfg.timeout_s:
            self._set(HALF_OPEN)
        return self.state != OPEN

    def record_success(self) -> None:
        if self.state == HALF_OPEN:
            self._successes += 1
            if self._successes >= self.cfg.success_threshold:
                self._set(CLOSED)
        elif self.state == CLOSED:
            self._failures.clear()

    def record_failure(self) -> None:
        if not self.cfg.enabled:
            return
        now = self._clock()
        if self.state == HALF_OPEN:
            self._open(now)
            return
        if self.state == OPEN:
            return
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.cfg.window_s:
            self._failures.popleft()
        if len(self._failures) >= self.cfg.failure_threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self._opened_at = now
        self._set(OPEN)

    def _set(self, state: str) -> None:
        if state != self.state:
            self.transitions += 1
        self.state = state
        self._successes = 0
        self._failures.clear()

    @property
    def code(self) -> int:
        return STATE_CODE[self.state]
