"""Fixtures for router tests against scripted engines (`fake_engine.FakeEngine`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from tests.router.fake_engine import FakeEngine
from tests.servers import Server, start_router


class Processes:
    """Fake engines and real `ember router` processes, all stopped at the end of a test."""

    def __init__(self) -> None:
        self.engines: list[FakeEngine] = []
        self.routers: list[Server] = []

    def engine(self, **kw: object) -> FakeEngine:
        e = FakeEngine(**kw)  # type: ignore[arg-type]
        self.engines.append(e)
        return e

    def router(
        self,
        prefill: Sequence[FakeEngine] = (),
        decode: Sequence[FakeEngine] = (),
        both: Sequence[FakeEngine] = (),
        extra: Sequence[str] = (),
        model: object = None,
    ) -> Server:
        r = start_router(model, prefill, decode, both, extra)  # type: ignore[arg-type]
        self.routers.append(r)
        return r


@pytest.fixture
def procs() -> Iterator[Processes]:
    p = Processes()
    try:
        yield p
    finally:
        for r in p.routers:
            r.stop()
        for e in p.engines:
            e.stop()
