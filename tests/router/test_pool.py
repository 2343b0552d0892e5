"""The router's pool learning from engines, over a scripted engine: KV events paged by the engine
(`"more": true`) are fetched to the end in one poll (through a real router process); a lost /load
answer does not take an engine out of rotation, a dead engine goes out at once (the pool itself)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import httpx

from ember.router.pool import DOWN_AFTER_LOST_POLLS, EndpointPool
from ember.trust import internal_headers
from tests.router.conftest import Processes
from tests.router.fake_engine import FakeEngine, wait_until
from tests.servers import SECRET


def seen(router_url: str) -> tuple[int, int]:
    r = httpx.get(f"{router_url}/load", headers=internal_headers(SECRET), timeout=5)
    ep = r.json()["endpoints"][0]
    return ep["kv_event_seq"], ep["cached_blocks"]


def test_paged_kv_events_are_fetched_to_the_end(procs: Processes) -> None:
    engine = procs.engine(page=2)
    # A slow poll: one page a poll would take 60 polls (a minute) to catch up.
    router = procs.router(both=[engine], extra=["--poll-interval", "1"])
    engine.events.extend(["stored", f"{i:064x}"] for i in range(120))
    t0 = time.monotonic()
    assert wait_until(lambda: seen(router.url) == (120, 120), 10), seen(router.url)
    assert time.monotonic() - t0 < 5
    pages = [c for c in engine.calls if c.path == "/kv_events"]
    assert len(pages) >= 60 and engine.refused == 0


def polls(
    pool: EndpointPool, engine: FakeEngine, n: int, before: Callable[[int], None]
) -> list[bool]:
    """`n` polls of the pool's one endpoint over one keep-alive session (as the router's own),
    `before(i)` called ahead of poll i; returns whether the endpoint was healthy after each."""
    ep = pool.endpoints[engine.url]

    async def run() -> list[bool]:
        healthy = []
        async with aiohttp.ClientSession(headers=internal_headers(SECRET)) as session:
            for i in range(n):
                before(i)
                await pool.poll(session, ep)
                healthy.append(ep.healthy)
        return healthy

    return asyncio.run(run())


def test_a_lost_load_answer_keeps_the_engine_in_rotation(procs: Processes) -> None:
    """One poll whose /load answer was lost (its connection closed with no reply, and so did
    aiohttp's one retry) used to take the engine out of rotation; now only `down_after` in a row
    do."""
    engine = procs.engine()
    pool = EndpointPool.build([], [engine.url], [])
    n = DOWN_AFTER_LOST_POLLS
    # Answered, lost once, answered, lost n - 1 times, answered, lost n times.
    plan = [False, True, False, *[True] * (n - 1), False, *[True] * n]

    def lose(i: int) -> None:
        engine.drop_loads = plan[i]

    healthy = polls(pool, engine, len(plan), lose)
    assert healthy == [True] * (len(plan) - 1) + [False], healthy
    assert pool.candidates("decode") == []
    engine.drop_loads = False
    assert polls(pool, engine, 1, lambda _: None) == [True]  # back once it answers


def test_a_dead_engine_goes_out_of_rotation_at_once(procs: Processes) -> None:
    """A refused connection is no lost answer: nothing listens, the engine is gone."""
    engine = procs.engine()
    pool = EndpointPool.build([], [engine.url], [], down_after=10)

    def kill(i: int) -> None:
        if i == 1:
            engine.kill()

    healthy = polls(pool, engine, 3, kill)
    # The first poll after the death may still find the kept-alive connection (its close is a
    # lost answer); the next connects afresh and is refused: out, long before 10 lost polls.
    assert healthy[0] is True and healthy[2] is False, healthy
