"""The host tier: slots, LRU eviction, reservations and pins."""

from __future__ import annotations

import hashlib

import pytest
import torch

from ember.kv.tiers.base import BlockLayout, TierHit
from ember.kv.tiers.host import HostTier

LAYOUT = BlockLayout(
    num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32", model="m"
)


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def put(host: HostTier, k: bytes, fill: int) -> int:
    (slot,) = host.reserve([k])
    assert slot is not None
    host.buffer[slot].fill_(fill)
    host.commit([k])
    return slot


def test_layout_nbytes_and_fingerprint() -> None:
    assert LAYOUT.nbytes == 2 * 2 * 4 * 2 * 4 * 4
    other = BlockLayout(2, 2, 4, 4, "bfloat16", "m")
    assert other.nbytes == LAYOUT.nbytes // 2
    assert other.fingerprint() != LAYOUT.fingerprint()
    assert BlockLayout(2, 2, 4, 4, "float32", "other").fingerprint() != LAYOUT.fingerprint()
    cache = torch.zeros(3, 2, 2, 4, 2, 4)
    assert BlockLayout.from_kv_cache(cache, "m") == LAYOUT
    with pytest.raises(ValueError, match="unknown torch dtype"):
        BlockLayout(2, 2, 4, 4, "float99", "m")


def test_tier_hit_counts() -> None:
    hit = TierHit(host=2, disk=1, store=3)
    assert hit.num_blocks == 6
    assert hit.by_medium() == {"cpu": 2, "disk": 1, "store": 3}


def test_reserved_entries_are_invisible_until_commit() -> None:
    host = HostTier(LAYOUT, 4, pin=False)
    assert host.buffer.shape == (4, LAYOUT.nbytes) and host.buffer.dtype == torch.uint8
    (slot,) = host.reserve([key(0)])
    assert slot is not None
    assert host.lookup(key(0)) is None and host.contains_prefix([key(0)]) == 0
    assert host.holds(key(0))
    assert host.reserve([key(0)]) == [None]  # being written already
    host.commit([key(0)])
    assert host.lookup(key(0)) == slot and host.contains_prefix([key(0), key(1)]) == 1
    (slot1,) = host.reserve([key(1)])
    host.abort([key(1)])
    assert not host.holds(key(1)) and host.lookup(key(1)) is None
    with pytest.raises(KeyError):
        host.commit([key(1)])
    assert host.stats().occupancy_blocks == 1


def test_lru_evicts_least_recently_used_within_capacity() -> None:
    host = HostTier(LAYOUT, 3, pin=False)
    for i in range(3):
        put(host, key(i), i)
    host.lookup(key(0))  # 1 is now the least recently used
    put(host, key(3), 3)
    assert host.lookup(key(1)) is None
    assert [host.lookup(key(i)) is not None for i in (0, 2, 3)] == [True, True, True]
    s = host.stats()
    assert s.evictions == 1 and s.occupancy_blocks == 3 == len(host)
    assert s.occupancy_bytes == 3 * LAYOUT.nbytes <= s.capacity_bytes


def test_contains_prefix_stops_at_the_first_gap() -> None:
    host = HostTier(LAYOUT, 4, pin=False)
    put(host, key(0), 0)
    put(host, key(2), 2)
    assert host.contains_prefix([key(0), key(1), key(2)]) == 1
    assert host.contains_prefix([key(1), key(2)]) == 0


def test_pinned_and_reserved_entries_are_never_evicted() -> None:
    host = HostTier(LAYOUT, 2, pin=False)
    a = put(host, key(0), 7)
    host.pin([key(0)])
    (b,) = host.reserve([key(1)])
    assert host.reserve([key(2)]) == [None]  # nothing left to evict
    host.commit([key(1)])
    (c,) = host.reserve([key(2)])  # evicts key 1, not the pinned key 0
    assert c == b and host.lookup(key(1)) is None
    assert host.lookup(key(0)) == a and bool((host.buffer[a] == 7).all())
    host.unpin([key(0)])
    host.commit([key(2)])
    host.lookup(key(2))
    assert host.reserve([key(3)]) == [a]  # unpinned: evictable again
    with pytest.raises(KeyError):
        host.unpin([key(0)])


def test_pin_counts_nest() -> None:
    host = HostTier(LAYOUT, 1, pin=False)
    put(host, key(0), 0)
    host.pin([key(0)])
    host.pin([key(0)])
    host.unpin([key(0)])
    assert host.reserve([key(1)]) == [None]
    host.unpin([key(0)])
    assert host.reserve([key(1)]) == [0]
