"""The eviction policies on the access patterns agents make: round-robin sessions over a cache that
holds fewer than all of them (LRU keeps nothing), a one-off scan beside a hot set, and sessions
that come back at different rates. A small simulated cache drives each policy as the host tier
and the GPU pool do: a request's chain is looked up from its start, used, and its missing blocks
are placed, evicting the policy's victims."""

from __future__ import annotations

import hashlib

import pytest

from ember.kv.eviction import LRU, NextUse, make_policy


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Cache:
    """`capacity` slots under a policy; `request(chain)` returns the blocks hit (the chain's
    longest resident prefix, as a prefix cache can use no more)."""

    def __init__(self, policy: str, capacity: int, clock: Clock) -> None:
        self.policy = make_policy(policy, capacity, clock)  # type: ignore[arg-type]
        self.slot_of: dict[bytes, int] = {}
        self.free = list(range(capacity))

    def request(self, chain: list[bytes]) -> int:
        hits = 0
        while hits < len(chain) and chain[hits] in self.slot_of:
            hits += 1
        self.policy.touch(chain)
        in_use = {self.slot_of[k] for k in chain if k in self.slot_of}
        for depth, key in enumerate(chain):
            if key in self.slot_of:
                continue
            if not self.free:
                victims = self.policy.victims(1, exclude=in_use)
                if not victims:
                    continue  # nothing evictable: the block is not kept
                (slot,) = victims
                old = next(k for k, s in self.slot_of.items() if s == slot)
                del self.slot_of[old]
                self.policy.clear(slot)
                self.free.append(slot)
            slot = self.free.pop()
            self.slot_of[key] = slot
            self.policy.place(slot, key, depth)
            in_use.add(slot)
        return hits


def chain(session: int, blocks: int, shared: int = 0) -> list[bytes]:
    """A session's prompt: `shared` blocks every session has (a system prompt), then its own."""
    out = [hashlib.sha256(b"system%d" % i).digest() for i in range(shared)]
    return out + [hashlib.sha256(b"s%d/%d" % (session, i)).digest() for i in range(blocks - shared)]


def round_robin(
    policy: str, sessions: int, blocks: int, capacity: int, rounds: int, grow: int = 0
) -> float:
    """Hit ratio over rounds 2.. of `sessions` taking turns, each turn `grow` blocks longer."""
    clock = Clock()
    cache = Cache(policy, capacity, clock)
    hit = asked = 0
    for r in range(rounds):
        for s in range(sessions):
            clock.t += 2.0  # a turn
            c = chain(s, blocks + r * grow, shared=4)
            h = cache.request(c)
            if r >= 1:
                # The blocks a turn could have hit: its prompt, less what it added this turn.
                hit, asked = hit + h, asked + len(c) - grow
    return hit / asked


def test_round_robin_over_more_sessions_than_fit_lru_keeps_nothing_next_use_keeps_most() -> None:
    # 16 sessions of 64 blocks against 760 slots: the working set is 1.35x the cache.
    lru = round_robin("lru", 16, 64, 760, rounds=6)
    nxt = round_robin("next-use", 16, 64, 760, rounds=6)
    assert lru < 0.1
    assert nxt >= 0.6, nxt


def test_round_robin_that_fits_hits_everything_either_way() -> None:
    for policy in ("lru", "next-use"):
        assert round_robin(policy, 8, 64, 8 * 64 + 8, rounds=4) >= 0.99


def test_growing_sessions_keep_their_new_blocks_with_them() -> None:
    # Each turn adds 4 blocks (the last answer and the next question); 8 sessions outgrow the
    # cache as they go: most of each prompt still hits.
    nxt = round_robin("next-use", 8, 48, 420, rounds=6, grow=4)
    lru = round_robin("lru", 8, 48, 420, rounds=6, grow=4)
    assert nxt >= 0.6, nxt
    assert nxt > lru + 0.3


def test_a_one_off_scan_does_not_flush_the_sessions_that_come_back() -> None:
    for policy, expect_kept in (("next-use", True), ("lru", False)):
        clock = Clock()
        cache = Cache(policy, 300, clock)
        for _ in range(4):  # 4 sessions of 50 blocks, taking turns: they fit
            for s in range(4):
                clock.t += 2.0
                cache.request(chain(s, 50))
        for i in range(3):  # one-off prompts of 100 blocks each, between the rounds
            clock.t += 2.0
            cache.request(chain(1000 + i, 100))
        clock.t += 2.0
        hits = [cache.request(chain(s, 50)) for s in range(4)]
        if expect_kept:
            assert hits == [50] * 4, hits
        else:
            assert sum(hits) < 100, hits


def test_a_frequent_session_stays_beside_rare_ones() -> None:
    clock = Clock()
    cache = Cache("next-use", 200, clock)
    hot = chain(0, 50)
    hot_hits = []
    for r in range(12):
        clock.t += 1.0
        hot_hits.append(cache.request(hot))
        if r % 2:  # rare sessions: more of them than fit beside the hot one
            for s in range(1, 5):
                clock.t += 1.0
                cache.request(chain(s, 50))
    assert hot_hits[4:] == [50] * 8, hot_hits  # once its intervals are known


def test_a_prefix_is_evicted_from_its_end() -> None:
    clock = Clock()
    policy = NextUse(8, clock)
    keys = chain(0, 8)
    for depth, key in enumerate(keys):
        policy.place(depth, key, depth)
    assert policy.victims(3) == [7, 6, 5]
    lru = LRU(8, clock)
    for depth, key in enumerate(keys):
        lru.place(depth, key, depth)
    assert lru.victims(3) == [7, 6, 5]


def test_victims_skip_excluded_and_changed_slots() -> None:
    clock = Clock()
    policy = LRU(4, clock)
    for slot in range(4):
        clock.t += 1.0
        policy.place(slot, b"k%d" % slot)
    assert policy.victims(1, exclude={0}) == [1]
    clock.t += 1.0
    policy.touch([b"k2"])  # used since the order was computed: no longer among the oldest
    policy.clear(3)
    assert policy.victims(3) == [0, 1, 2]  # 3 is empty; 2, used last, now goes last


def test_history_comes_back_with_a_block_and_is_bounded() -> None:
    clock = Clock()
    policy = NextUse(2, clock, history=8)
    policy.place(0, b"a", 5)
    policy.clear(0)
    clock.t += 10.0
    policy.touch([b"p%d" % i for i in range(5)] + [b"a"])  # used while not held
    policy.place(1, b"a")  # back: its interval and depth come with it
    assert policy._interval[1] == pytest.approx(10.0)
    assert policy._depth[1] == 5
    policy.clear(1)
    for i in range(10):
        policy.touch([b"x%d" % i])
    assert len(policy._ghosts) == 8 and b"a" not in policy._ghosts


def test_uses_closer_than_a_moment_are_one() -> None:
    clock = Clock()
    policy = NextUse(1, clock)
    policy.place(0, b"a")  # written down before its request ended: not a use yet
    for _ in range(5):  # the request ends (its first use, at +0.01), others of its turn
        clock.t += 0.01
        policy.touch([b"a"])
    assert policy._interval[0] != policy._interval[0]  # still unknown (NaN)
    clock.t += 20.0
    policy.touch([b"a"])
    assert policy._interval[0] == pytest.approx(20.04)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shrink"):
        NextUse(4).resize(2)


def test_with_no_interval_known_the_typical_one_is_twice_the_median_age() -> None:
    clock = Clock()
    policy = NextUse(4, clock)
    assert policy.typical_interval() == 30.0  # empty: the default
    for slot in range(3):
        policy.place(slot, b"k%d" % slot)
        clock.t += 1.0
    # Ages 3, 2 and 1 s: a round-robin of period ~4 s, where the most recent goes first.
    assert policy.typical_interval() == pytest.approx(4.0)
    assert policy.victims(1) == [2]
