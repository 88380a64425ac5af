"""A circuit breaker for advisory dependencies (the Redis index): stop calling a service
that keeps failing, probe it again after a cooldown.

    closed --N consecutive failures--> open --cooldown--> half-open (one probe)
    half-open --probe succeeds--> closed;  --probe fails--> open (cooldown restarts)
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    """Not thread-safe: use it from one event loop."""

    def __init__(self, failures: int, cooldown_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or cooldown_s <= 0:
            raise ValueError("failures must be >= 1 and cooldown_s > 0")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._state = CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False

    @property
    def state(self) -> str:
        if self._state == OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            return HALF_OPEN
        return self._state

    def allow(self) -> bool:
        """May a call go out now? In half-open state only one probe at a time does."""
        state = self.state
        if state == CLOSED:
            return True
        if state == HALF_OPEN and not self._probing:
            self._probing = True
            return True
        return False

    def record_success(self) -> bool:
        """Returns True when this success closed an open breaker."""
        was_open = self._state == OPEN
        self._state, self._consecutive, self._probing = CLOSED, 0, False
        return was_open

    def record_failure(self) -> bool:
        """Returns True when this failure opened the breaker (from closed or a probe)."""
        self._consecutive += 1
        probe_failed = self._probing
        self._probing = False
        if probe_failed or (self._state == CLOSED and self._consecutive >= self.failures):
            self._state, self._opened_at = OPEN, self._clock()
            return True
        return False
