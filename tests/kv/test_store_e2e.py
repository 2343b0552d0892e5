"""The shared KV store across real processes: a `mooncake_master` started here and `ember serve`
engines of the tiny model with `--kv-store` (and a small GPU pool). A prompt computed on engine A is
served from the store on engine B (usage's cached_tokens, the same greedy answer), and a router over
both credits B for A's blocks; with the master killed both keep answering (recompute, no 5xx).
Disaggregated: turn 2 of a chat goes through another prefill engine than turn 1 and hits in the
store."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from ember.kv.tiers.store_master import StoreMaster, start_master
from ember.trust import internal_headers
from tests.servers import SECRET, Server, start_router, start_server, wait_healthy

pytest.importorskip("mooncake.store", reason="the Mooncake Store is not installed")

PROMPT_BLOCKS = 50
"""Full blocks of the long prompt (16 tokens each): most of the 64-block GPU pool."""


def engine_args(master: StoreMaster) -> tuple[str, ...]:
    return (
        "--cpu-threads", "1", "--num-kv-blocks", "64", "--kv-store", master.address,
        "--kv-store-gb", "0.03",
    )  # fmt: skip


def store_counter(server: Server, name: str) -> float:
    """`ember:kv_tier_<name>{medium="store"}` of the engine's /metrics (0 if absent)."""
    text = httpx.get(f"{server.url}/metrics", headers=internal_headers(SECRET), timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"ember:kv_tier_{name}") and 'medium="store"' in line:
            return float(line.split()[-1])
    return 0.0


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def complete(server: Server, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


@dataclass
class Pair:
    master: StoreMaster
    a: Server
    b: Server
    router: Server


@pytest.fixture(scope="module")
def pair(tiny_model_dir) -> Iterator[Pair]:
    model = tiny_model_dir("llama")
    master = start_master()
    servers: list[Server] = []
    try:
        servers += [start_server(model, *engine_args(master), wait=False) for _ in range(2)]
        for s in servers:
            wait_healthy(s)
        servers.append(start_router(model, both=servers[:2]))
        yield Pair(master, *servers)
    finally:
        for s in reversed(servers):
            s.stop()
        master.stop()


def test_engine_b_loads_engine_a_blocks_from_the_store_and_the_router_credits_it(
    pair: Pair,
) -> None:
    prompt = [random.Random(7).randrange(10, 3000) for _ in range(PROMPT_BLOCKS * 16 + 5)]
    first = complete(pair.a, prompt)
    assert cached(first) == 0
    wait_for(
        lambda: store_counter(pair.a, "blocks_in_total") >= PROMPT_BLOCKS,
        "engine A's blocks written to the store",
    )
    assert pair.a.load()["kv_store"] == pair.master.address

    # The router heard A's events: B, on the same store, is credited for A's blocks.
    def credited() -> dict[str, int]:
        eps = pair.router.load()["endpoints"]
        return {e["url"]: e["store_blocks"] for e in eps if e["kv_store"] == pair.master.address}

    wait_for(
        lambda: credited().get(pair.b.url, 0) >= PROMPT_BLOCKS, "the router's store credit for B"
    )

    second = complete(pair.b, prompt)
    assert cached(second) > 0  # B never saw this prompt: its blocks came from the store
    assert store_counter(pair.b, "hits_total") > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_with_the_master_killed_both_engines_keep_answering(pair: Pair) -> None:
    rng = random.Random(8)
    prompt = [rng.randrange(10, 3000) for _ in range(20 * 16)]
    before = complete(pair.a, prompt)
    pair.master.kill()
    for server in (pair.a, pair.b, pair.router):
        for p in (prompt, [rng.randrange(10, 3000) for _ in range(20 * 16)]):
            answer = complete(server, p)  # asserts a 200
            if p is prompt:
                assert answer["choices"][0]["text"] == before["choices"][0]["text"]


def chat(router: Server, messages: list[dict]) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_next_turn_on_another_prefill_engine_hits_in_the_store(tiny_model_dir) -> None:
    """PD: prefill engines P1 and P2 and a decode engine D share a store; turn 1 goes through P1
    (one router), turn 2 of the same conversation through P2 (another router over P2 and D): P2
    loads turn 1's prompt from the store, and the answer's cached_tokens (the prefill side's)
    shows it."""
    model = tiny_model_dir("llama")
    master = start_master()
    servers: list[Server] = []
    try:
        args = engine_args(master)
        for role in ("prefill", "prefill", "decode"):
            servers.append(start_server(model, *args, "--role", role, wait=False))
        for s in servers:
            wait_healthy(s)
        p1, p2, d = servers
        split = ["--disagg-min-uncached", "0"]  # every request takes both legs
        servers.append(start_router(model, prefill=[p1], decode=[d], extra=split))
        servers.append(start_router(model, prefill=[p2], decode=[d], extra=split))
        r1, r2 = servers[3:]

        words = random.Random(9).choices(["alpha", "beta", "gamma", "delta", "kappa"], k=250)
        messages = [{"role": "user", "content": " ".join(words)}]
        one = chat(r1, messages)
        assert p1.load()["prefix_cache_queries"] > 0 and p2.load()["prefix_cache_queries"] == 0
        wait_for(lambda: store_counter(p1, "blocks_in_total") >= 10, "P1's blocks in the store")

        messages += [one["choices"][0]["message"], {"role": "user", "content": "and then?"}]
        two = chat(r2, messages)
        assert two["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert store_counter(p2, "hits_total") > 0
    finally:
        for s in reversed(servers):
            s.stop()
        master.stop()
