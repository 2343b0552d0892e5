"""The router's pool learning from engines, through a real router process over a scripted engine:
KV events paged by the engine (`"more": true`) are fetched to the end in one poll."""

from __future__ import annotations

import time

import httpx

from ember.trust import internal_headers
from tests.router.conftest import Processes
from tests.router.fake_engine import wait_until
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
