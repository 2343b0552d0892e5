"""An asyncio loop with a virtual clock, so timing arithmetic can be checked exactly.

`loop.time()` stands still while anything is ready to run; when the loop would wait, it first
polls the real sockets for up to `REAL_WAIT_S` of real time (loopback I/O in flight: a write by
one side is readable by the other at once) and only when nothing arrives jumps the clock to the
next timer. So an `asyncio.sleep(0.03)` takes exactly 0.03 s of loop time however slow or loaded
the machine is, and I/O takes none.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
REAL_WAIT_S = 0.01


class _Selector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None or timeout <= 0:  # None: no timer to jump to, only real I/O wakes us
            return super().select(timeout)
        ready = super().select(min(timeout, REAL_WAIT_S))
        if not ready:
            assert self.loop is not None
            self.loop.advance(timeout)
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _Selector()
        super().__init__(selector)
        selector.loop = self
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds


def run(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on a VirtualTimeLoop."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)
