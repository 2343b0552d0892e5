"""Where an engine's start-up time goes: seconds per phase (loading, KV sizing, graphs, warm-up),
logged once the engine is ready, with the process's age (imports and spawning included).

A user's first minute with ember is its start-up, meant to stay under 10 s on a fresh machine,
so each start says where its seconds went.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), None where that is not known."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22, after the command name in parentheses (which may hold spaces).
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Seconds between marks: `mark("load")` closes the phase that began at the last mark."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()
        self.age_at_start = process_age_s()
        """The process's age when the clock started: its start, imports and anything before."""

    def mark(self, phase: str) -> float:
        now = time.perf_counter()
        seconds = now - self._last
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        self._last = now
        return seconds

    def summary(self) -> str:
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.phases.items())
        age = process_age_s()
        if age is None or self.age_at_start is None:
            return parts
        return (
            f"{parts}; {age:.1f} s since the process started, "
            f"{self.age_at_start:.1f} s of it (start, imports) before the first phase"
        )

    def report(self) -> None:
        log.info("start-up: %s", self.summary())
