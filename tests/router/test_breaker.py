from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.router.breaker import BreakerState, CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def opened(clock: FakeClock) -> CircuitBreaker:
    b = CircuitBreaker(failure_threshold=3, cooldown_s=5.0, clock=clock)
    for _ in range(3):
        b.record_failure()
    assert b.state is BreakerState.OPEN
    return b


def test_closed_allows_and_opens_after_consecutive_failures() -> None:
    clock = FakeClock()
    b = CircuitBreaker(clock=clock)
    assert b.state is BreakerState.CLOSED and b.allow()
    b.record_failure()
    b.record_failure()
    assert b.state is BreakerState.CLOSED and b.allow()
    b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allow()


def test_a_success_resets_the_failure_count() -> None:
    b = CircuitBreaker(failure_threshold=3, clock=FakeClock())
    for _ in range(10):
        b.record_failure()
        b.record_failure()
        b.record_success()
    assert b.state is BreakerState.CLOSED and b.consecutive_failures == 0


def test_open_rejects_until_the_cooldown_then_lets_one_trial_through() -> None:
    clock = FakeClock()
    b = opened(clock)
    clock.now += 4.99
    assert not b.allow() and b.state is BreakerState.OPEN
    clock.now += 0.01
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow()
    assert not b.allow() and not b.allow()  # only one trial
    assert b.state is BreakerState.HALF_OPEN


def test_available_peeks_without_taking_the_trial() -> None:
    clock = FakeClock()
    b = opened(clock)
    assert not b.available
    clock.now += 5.0
    assert b.available and b.available  # still there to take
    assert b.allow()
    assert not b.available and not b.allow()


def test_a_successful_trial_closes_the_circuit() -> None:
    clock = FakeClock()
    b = opened(clock)
    clock.now += 5.0
    assert b.allow()
    b.record_success()
    assert b.state is BreakerState.CLOSED
    assert all(b.allow() for _ in range(5))


def test_a_failed_trial_reopens_for_a_full_cooldown() -> None:
    clock = FakeClock()
    b = opened(clock)
    clock.now += 5.0
    assert b.allow()
    clock.now += 1.0
    b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allow()
    clock.now += 4.9
    assert not b.allow()
    clock.now += 0.1
    assert b.allow()  # next trial


def test_a_trial_never_reported_is_given_up_after_a_cooldown() -> None:
    clock = FakeClock()
    b = opened(clock)
    clock.now += 5.0
    assert b.allow()
    clock.now += 4.0
    assert not b.allow()
    clock.now += 1.0
    assert b.allow()  # the first trial's client vanished; try again


def test_late_outcomes_while_open_change_nothing() -> None:
    clock = FakeClock()
    b = opened(clock)
    clock.now += 3.0
    b.record_success()  # a request let through before the circuit opened
    b.record_failure()
    assert b.state is BreakerState.OPEN
    clock.now += 2.0  # the cooldown still runs from the opening, not the late failure
    assert b.state is BreakerState.HALF_OPEN


def test_arguments_are_validated() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(cooldown_s=-1.0)


ops = st.lists(
    st.one_of(
        st.just("allow"),
        st.just("ok"),
        st.just("fail"),
        st.floats(0.0, 3.0).map(lambda dt: ("tick", dt)),
    ),
    max_size=60,
)


@given(ops=ops)
def test_invariants_under_any_sequence(ops: list[object]) -> None:
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=2, cooldown_s=2.0, clock=clock)
    last_trial: float | None = None  # when half-open last let a request through
    for op in ops:
        before = b.state
        if isinstance(op, tuple):
            clock.now += op[1]
        elif op == "allow":
            peek = b.available
            allowed = b.allow()
            assert peek == allowed
            if before is BreakerState.CLOSED:
                assert allowed
            elif before is BreakerState.OPEN:
                assert not allowed
            elif allowed:
                # one trial per cooldown: a second only once the first is given up
                assert last_trial is None or clock.now - last_trial >= b.cooldown_s
                last_trial = clock.now
        elif op == "ok":
            b.record_success()
            if before is not BreakerState.OPEN:
                assert b.state is BreakerState.CLOSED
        else:
            b.record_failure()
            if before is BreakerState.HALF_OPEN:
                assert b.state is BreakerState.OPEN
        if b.state is not BreakerState.HALF_OPEN:
            last_trial = None
        if b.state is BreakerState.CLOSED:
            assert b.consecutive_failures < b.failure_threshold
