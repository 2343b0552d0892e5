"""Circuit breaker per endpoint: after `failure_threshold` consecutive failures stop sending to it
for `cooldown_s`, then let one trial request through; its outcome closes or re-opens the circuit."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """closed --threshold failures--> open --cooldown--> half-open --trial ok--> closed
    (a failed trial re-opens it for another cooldown)."""

    __slots__ = (
        "failure_threshold",
        "cooldown_s",
        "_clock",
        "_state",
        "_failures",
        "_opened_at",
        "_trial_at",
    )

    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trial_at: float | None = None  # when the half-open trial went out; None: none out

    @property
    def state(self) -> BreakerState:
        """The state now: an open circuit whose cooldown has passed reads as half-open."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self._state = BreakerState.HALF_OPEN
            self._trial_at = None
        return self._state

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    @property
    def available(self) -> bool:
        """Whether `allow()` would say True now, without taking the half-open trial: for filtering
        candidates before one is chosen (then call `allow()` on the chosen one only)."""
        state = self.state
        if state is BreakerState.HALF_OPEN:
            return self._trial_at is None or self._clock() - self._trial_at >= self.cooldown_s
        return state is BreakerState.CLOSED

    def allow(self) -> bool:
        """May a request go to this endpoint now? In half-open, True once: the caller must report
        that request's outcome. A trial never reported (its client vanished) is given up after
        another `cooldown_s`, so a lost outcome cannot shut the endpoint out for good."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN:
            return False
        now = self._clock()
        if self._trial_at is not None and now - self._trial_at < self.cooldown_s:
            return False
        self._trial_at = now
        return True

    def record_success(self) -> None:
        """A request succeeded. In half-open this closes the circuit. While open, late outcomes
        of requests let through before it opened are ignored."""
        if self.state is BreakerState.OPEN:
            return
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._trial_at = None

    def record_failure(self) -> None:
        """A request failed: counts towards opening when closed, re-opens when half-open."""
        state = self.state
        if state is BreakerState.OPEN:
            return
        self._failures += 1
        if state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            self._trial_at = None
