"""The scheduler's read path from the KV tiers, against a fake TierManager whose loads end at random
steps and may come back short: no block leaks or is freed twice, a loading request holds exactly
its blocks, a finished load publishes only the blocks that arrived, and an abort mid-load frees
everything at once."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.engine.request import RequestStatus
from ember.engine.scheduler import Scheduler, SchedulerConfig
from ember.kv.kv_cache_manager import KVCacheManager
from ember.kv.tiers.base import TierHit
from tests.engine.test_scheduler import BLOCK, Stepper, make_request


class FakeTiers:
    """Holds every block ever published (as write-through would); loads end when the test says."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.stored: set[bytes] = set()
        self.loads: dict[str, tuple[list[bytes], list[int]]] = {}
        self.cancelled: list[str] = []
        self.started = 0

    def lookup(self, keys: Sequence[bytes]) -> TierHit:
        n = 0
        while n < len(keys) and keys[n] in self.stored:
            n += 1
        return TierHit(host=n)

    def plan(self, hit: TierHit, prefill_tok_s: float | None = None) -> TierHit:
        return hit

    def start_load(self, load_id: str, keys: Sequence[bytes], gpu_block_ids: list[int]) -> None:
        assert load_id not in self.loads
        assert len(keys) == len(gpu_block_ids) > 0
        self.loads[load_id] = (list(keys), list(gpu_block_ids))
        self.started += 1

    def poll_loads(self) -> list[tuple[str, int]]:
        done = [lid for lid in self.loads if self.rng.random() < 0.5]
        out = []
        for lid in done:
            keys, _ = self.loads.pop(lid)
            # A short load now and then: an entry went missing or was corrupt.
            out.append(
                (lid, len(keys) if self.rng.random() < 0.7 else self.rng.randrange(len(keys)))
            )
        return out

    def cancel(self, load_id: str) -> None:
        self.loads.pop(load_id, None)
        self.cancelled.append(load_id)


def check(s: Scheduler, tiers: FakeTiers) -> None:
    kv, pool = s.kv, s.kv.pool
    held: Counter[int] = Counter()
    for rid, req in s.requests.items():
        ids = kv.block_ids(rid)
        assert len(ids) == len(set(ids))
        held.update(ids)
        if req.status == RequestStatus.WAITING_FOR_TIER_KV:
            assert rid in s.loading and rid in s.tier_loads and rid in tiers.loads
            keys, gpu_ids = tiers.loads[rid]
            g = s.tier_loads[rid].num_gpu_blocks
            assert ids == ids[:g] + gpu_ids  # the hit, then exactly the blocks being loaded
            # Blocks being loaded are not published until they arrive.
            assert all(pool.blocks[b].block_hash is None for b in gpu_ids)
        elif req.status == RequestStatus.RUNNING:
            assert len(ids) * BLOCK >= req.num_computed_tokens
            computed = req.num_computed_tokens // BLOCK
            for i, b in enumerate(ids):
                h = pool.blocks[b].block_hash
                if i < computed:
                    assert h is None or h == req.block_hashes[i], "published under another hash"
                else:
                    assert h is None, "a block whose KV is not written yet is published"
        else:
            assert ids == [], "a waiting request holds blocks"
    assert set(tiers.loads) == set(s.tier_loads) == set(s.loading)
    for b in pool.blocks:
        assert b.ref_cnt == held[b.block_id]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 8), st.integers(0, 2)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    min_size=20,
    max_size=80,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops, num_blocks=st.integers(16, 40), budget=st.integers(4, 64), seed=st.integers(0, 2**16)
)
def test_random_tier_loads_never_leak_blocks(ops, num_blocks, budget, seed) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, BLOCK, track_writes=True)
    tiers = FakeTiers(rng)
    config = SchedulerConfig(4, budget, max_model_len=num_blocks * BLOCK)
    s = Scheduler(config, kv, tiers=tiers)  # type: ignore[arg-type]
    stepper = Stepper(s, rng)
    prefixes = [[rng.randrange(1, 50) for _ in range(40)] for _ in range(3)]
    n = 0

    def step() -> None:
        stepper.step()
        tiers.stored.update(h for _, h in kv.pool.drain_published())
        # The device evicts free blocks now and then: the tiers must serve what it dropped.
        for b in list(kv.pool._free.values()):
            if b.block_hash is not None and rng.random() < 0.6:
                kv.pool.uncache(b)

    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, prefix = op
            prompt = prefixes[prefix] + [rng.randrange(1, 50) for _ in range(plen)]
            s.add_request(make_request(str(n), prompt[: s.config.max_model_len - 1], max_tokens))
            n += 1
        elif op[0] == "step":
            step()
        else:
            live = list(s.requests)
            if live:
                s.finish_requests([live[op[1] % len(live)]], RequestStatus.FINISHED_ABORTED)
        check(s, tiers)
    for _ in range(10_000):
        if not stepper.busy:
            break
        step()
        check(s, tiers)
    assert not stepper.busy, "scheduler stalled"
    assert kv.pool.num_free_blocks == num_blocks


def test_short_load_recomputes_the_rest_and_counts_what_arrived() -> None:
    kv = KVCacheManager(32, BLOCK, track_writes=True)
    tiers = FakeTiers(random.Random(0))
    s = Scheduler(SchedulerConfig(4, 64, 128), kv, tiers=tiers)  # type: ignore[arg-type]
    prompt = list(range(1, 27))  # six full blocks and two tokens
    tiers.stored.update(kv.update_block_hashes([], prompt, None))
    req = make_request("a", prompt, 2)
    s.add_request(req)
    assert s.schedule().is_empty  # admitted into the loading state, nothing to run yet
    assert req.status == RequestStatus.WAITING_FOR_TIER_KV
    assert len(tiers.loads["a"][0]) == 6
    tiers.poll_loads = lambda: [("a", 4)]  # type: ignore[method-assign]
    out = s.schedule()
    # Four blocks arrived (published, cached), the other two are recomputed with the tail.
    assert req.num_cached_tokens == 4 * BLOCK and s.prefix_hits == 4 * BLOCK
    assert out.num_computed_tokens == [4 * BLOCK] and out.num_scheduled_tokens == [26 - 16]
    published = [kv.pool.blocks[b].block_hash for b in kv.block_ids("a")]
    assert published[:4] == req.block_hashes[:4]
