"""The start-up clock: seconds per phase, summed when a phase repeats, and the process's age."""

from __future__ import annotations

import logging
import time

import pytest

from ember.engine.startup_clock import StartupClock, process_age_s


def test_phases_are_timed_between_marks_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    clock = StartupClock()
    time.sleep(0.02)
    assert clock.mark("load") >= 0.02
    clock.mark("graphs")
    time.sleep(0.01)
    clock.mark("load")  # a phase that comes back adds up
    assert list(clock.phases) == ["load", "graphs"]
    assert clock.phases["load"] >= 0.03 and clock.phases["graphs"] < 0.01
    with caplog.at_level(logging.INFO, logger="ember.engine.startup_clock"):
        clock.report()
    assert "start-up: load 0.0 s, graphs 0.0 s" in caplog.text
    if clock.age_at_start is not None:  # Linux: the time before the first phase is said too
        assert 0 < clock.age_at_start <= process_age_s()
        assert "before the first phase" in caplog.text


def test_the_process_age_is_positive_and_below_the_test_runs_own() -> None:
    age = process_age_s()
    if age is None:
        pytest.skip("no /proc here")
    t0 = time.monotonic()
    assert age > 0
    assert process_age_s() >= age - 0.05  # clock ticks are 10 ms: never backwards beyond that
    assert time.monotonic() - t0 < 1
