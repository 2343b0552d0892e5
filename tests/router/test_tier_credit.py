"""The router's prefix credit for KV tiers, over scripted engines polled through HTTP: an engine is
credited for the blocks in its host and disk tiers (its KV events' medium) after its GPU prefix, as
it looks them up itself; every engine on a shared store for what any of them wrote there (a hint
with an age limit, gone with the engine that wrote it); and a GPU hit costs less than a tier hit,
which costs less than a miss."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from ember.router.endpoint import TIER_LOAD_WEIGHT
from ember.router.pool import STORE_CREDIT_TTL_S, EndpointPool
from ember.router.prefix_index import PrefixIndex, StoreIndex
from ember.router.prompt import PromptInfo
from ember.trust import internal_headers
from tests.router.conftest import Processes
from tests.router.fake_engine import FakeEngine
from tests.servers import SECRET

ROOT = bytes.fromhex("ab" * 32)  # the fake engine's kv_root_hash
BS = 16  # and its block size
PROMPT = PromptInfo(8 * BS + 1, list(range(1000, 1000 + 8 * BS + 1)))
HASHES = PROMPT.hashes(ROOT, BS)
STORE = "127.0.0.1:50051"


def events(kind: str, medium: str, blocks: range) -> list[list[str]]:
    return [[kind, HASHES[i].hex(), medium] for i in blocks]


def poll(pool: EndpointPool, *engines: FakeEngine) -> None:
    """One poll of each engine, as the router's background task makes."""

    async def run() -> None:
        async with aiohttp.ClientSession(headers=internal_headers(SECRET)) as session:
            for e in engines:
                await pool.poll(session, pool.endpoints[e.url])

    asyncio.run(run())


def credit(pool: EndpointPool, engine: FakeEngine, now: float | None = None) -> dict[str, int]:
    return pool.credit(PROMPT, [engine.url], now)[engine.url].tokens


def test_host_and_disk_blocks_count_after_the_gpu_prefix_as_the_engine_looks_them_up(
    procs: Processes,
) -> None:
    engine = procs.engine()
    engine.events += [["stored", h.hex()] for h in HASHES[:2]]  # an engine without media: GPU
    engine.events += events("stored", "cpu", range(4))
    engine.events += events("stored", "disk", range(4, 6))
    pool = EndpointPool.build([], [], [engine.url])
    poll(pool, engine)
    assert credit(pool, engine) == {"gpu": 2 * BS, "cpu": 2 * BS, "disk": 2 * BS}
    assert pool.cached_tokens(PROMPT, [engine.url]) == {engine.url: 6 * BS}

    # Host loses block 2: the engine's host lookup stops there, and its disk has no block 2.
    engine.events += events("removed", "cpu", range(2, 3))
    poll(pool, engine)
    assert credit(pool, engine) == {"gpu": 2 * BS}
    # A medium the router does not know is ignored, not an error.
    engine.events += events("stored", "tape", range(8))
    poll(pool, engine)
    assert credit(pool, engine) == {"gpu": 2 * BS} and pool.endpoints[engine.url].healthy


def test_every_engine_on_a_store_is_credited_for_what_one_of_them_wrote(procs: Processes) -> None:
    writer = procs.engine(kv_store=STORE)
    reader = procs.engine(kv_store=STORE)
    elsewhere = procs.engine(kv_store="127.0.0.2:50051")
    alone = procs.engine()
    writer.events += events("stored", "gpu", range(8))
    pool = EndpointPool.build([], [], [e.url for e in (writer, reader, elsewhere, alone)])
    poll(pool, writer, reader, elsewhere, alone)
    # The whole prompt but its last token, which every engine computes.
    assert credit(pool, writer) == {"gpu": 8 * BS}
    assert credit(pool, reader) == {"store": 8 * BS}
    assert credit(pool, elsewhere) == {} and credit(pool, alone) == {}

    # Evicted from the writer's GPU, the blocks stay in the store: the writer loads them too.
    writer.events += events("removed", "gpu", range(8))
    poll(pool, writer)
    assert credit(pool, writer) == {"store": 8 * BS}
    assert credit(pool, reader) == {"store": 8 * BS}


def test_store_credit_ages_out_and_leaves_with_the_engine_that_wrote_it(procs: Processes) -> None:
    writer = procs.engine(kv_store=STORE)
    reader = procs.engine(kv_store=STORE)
    writer.events += events("stored", "cpu", range(4))
    pool = EndpointPool.build([], [], [writer.url, reader.url])
    poll(pool, writer, reader)
    assert credit(pool, reader) == {"store": 4 * BS}
    later = time.monotonic() + STORE_CREDIT_TTL_S + 1
    assert credit(pool, reader, now=later) == {}

    pool.endpoints[writer.url].healthy = False  # down: its segment of the store likely gone
    assert credit(pool, reader) == {}
    pool.endpoints[writer.url].healthy = True
    assert credit(pool, reader) == {"store": 4 * BS}
    writer.engine_id = "restarted"  # a new process: the old one's segment left the store
    writer.events.clear()
    poll(pool, writer)
    assert credit(pool, reader) == {} and credit(pool, writer) == {}


def test_a_gpu_hit_beats_a_tier_hit_which_beats_a_miss(procs: Processes) -> None:
    gpu = procs.engine(kv_store=STORE)
    host, store, miss = procs.engine(), procs.engine(kv_store=STORE), procs.engine()
    gpu.events += events("stored", "gpu", range(8))
    host.events += events("stored", "cpu", range(8))
    pool = EndpointPool.build([], [], [e.url for e in (gpu, host, store, miss)])
    poll(pool, gpu, host, store, miss)
    order = []
    tried: set[str] = set()
    for _ in range(4):
        choice = pool.choose("prefill", PROMPT, None, exclude=tried)
        order.append(choice.endpoint.url)
        tried.add(choice.endpoint.url)
        if choice.endpoint.url != miss.url:
            assert choice.cached_tokens == 8 * BS and choice.uncached_tokens == 1
    assert order == [gpu.url, host.url, store.url, miss.url]

    # A tier hit is still work: an engine with the blocks on its GPU but a queue longer than the
    # load of them from host loses to the host hit.
    load = TIER_LOAD_WEIGHT["cpu"] * 8 * BS
    pool.endpoints[gpu.url].add_load(prefill_tokens=int(load) + 1)
    assert pool.choose("prefill", PROMPT, None).endpoint.url == host.url


def test_tier_indexes_stay_bounded() -> None:
    index = PrefixIndex(max_blocks_per_url=3)
    index.apply("http://a", HASHES[:5], [])
    assert index.num_blocks("http://a") == 3
    assert index.match(HASHES[2:5]) == {"http://a": 3}  # the oldest went first
    index.apply("http://a", [HASHES[2]], [])  # stored again: now the newest
    index.apply("http://a", [HASHES[6]], [])
    assert index.match(HASHES[2:3]) == {"http://a": 1} and index.match(HASHES[3:4]) == {}

    store = StoreIndex(ttl_s=10.0, max_blocks=3)
    store.add(STORE, "http://a", HASHES[:5], now=0.0)
    assert store.num_blocks(STORE, now=0.0) == 3
    assert store.match(STORE, HASHES[2:], now=0.0) == 3 and store.match(STORE, HASHES, 0.0) == 0
    assert store.num_blocks(STORE, now=11.0) == 0
    with pytest.raises(ValueError):
        PrefixIndex(max_blocks_per_url=0)
