"""The engine's eviction under an agent load, on the CPU with a tiny model: sessions taking turns
round-robin over a device pool and a host tier that together hold fewer than all of them. LRU then
evicts each session just before it comes back and keeps no hits; next-use keeps most of them. The
tiers count a lookup that finds nothing as a miss, and the host tier is whole before the first
request."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ember.entrypoints.llm import LLM
from ember.sampling_params import SamplingParams

BLOCK = 16
POOL = 48  # device blocks: two sessions and a half
SESSIONS = 6
PROMPT = 300  # tokens: ~19 blocks a session, ~21 by the last round
HOST_BLOCKS = 64  # the host tier: ~3.5 of the 6 sessions
ROUNDS = 4
TURN_S = 2.0
OUT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


class Clock:
    """The eviction policies' clock, a turn apart (the engine's own steps take milliseconds)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 3000) for _ in range(n)]


def round_robin(model: Path, eviction: str) -> tuple[float, LLM]:
    """Hit ratio (cached prompt tokens over the prompt tokens a turn could have hit: all but its
    new message) over rounds 2 on, and the engine (still open)."""
    probe = LLM(str(model), max_model_len=POOL * BLOCK, num_kv_blocks=POOL, cpu_threads=1)
    nbytes = (
        probe.engine.core.runner.kv_cache[0].numel()
        * probe.engine.core.runner.kv_cache.element_size()
    )
    probe.close()
    llm = LLM(
        str(model),
        max_model_len=POOL * BLOCK,
        num_kv_blocks=POOL,
        cpu_threads=1,
        kv_host_gb=HOST_BLOCKS * nbytes / (1 << 30),
        kv_eviction=eviction,
    )
    core = llm.engine.core
    assert core.tiers is not None
    host = core.tiers.host
    # Whole before the first request: its capacity is not grown beside the load.
    assert host.capacity_blocks == host.target_blocks == HOST_BLOCKS
    clock = Clock()
    core.kv.pool.policy.clock = clock
    host.policy.clock = clock
    prompts = [tokens(s, PROMPT) for s in range(SESSIONS)]
    hit = asked = 0
    for r in range(ROUNDS):
        for s in range(SESSIONS):
            clock.t += TURN_S
            out = llm.generate([prompts[s]], OUT)[0]
            if r:
                hit += out.num_cached_tokens
                asked += len(prompts[s]) - 20
            prompts[s] = prompts[s] + list(out.outputs[0].token_ids) + tokens(100 * r + s, 20)
    return hit / asked, llm


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def test_round_robin_sessions_keep_their_hits_under_next_use_not_under_lru(model: Path) -> None:
    lru, lru_llm = round_robin(model, "lru")
    try:
        misses = lru_llm.engine.core.stats().kv_tiers["cpu"].misses
        # Every turn after the first looked its prompt up and found little: counted.
        assert misses >= (ROUNDS - 1) * SESSIONS * 10
    finally:
        lru_llm.close()
    nxt, nxt_llm = round_robin(model, "next-use")
    try:
        host = nxt_llm.engine.core.stats().kv_tiers["cpu"]
        assert host.hits > 0 and host.misses > 0
    finally:
        nxt_llm.close()
    assert lru < 0.1, lru
    assert nxt >= 0.4, nxt  # the host alone could keep 64 of ~110 blocks: 0.59
