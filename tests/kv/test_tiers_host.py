"""The host tier: slots, eviction in its policy's order, reservations and pins."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch

from ember.kv.tiers.base import BlockLayout, TierHit
from ember.kv.tiers.host import HostTier
from tests.kv.test_tiers_prefetch import eventually

LAYOUT = BlockLayout(
    num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32", model="m"
)


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def put(host: HostTier, k: bytes, fill: int) -> int:
    (slot,) = host.reserve([k])
    assert slot is not None
    host.row(slot).fill_(fill)
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
    assert host.capacity_blocks == 4 and host.row(3).shape == (LAYOUT.nbytes,)
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
    host = HostTier(LAYOUT, 3, pin=False, eviction="lru")
    for i in range(3):
        put(host, key(i), i)
    host.touch([key(0)])  # 1 is now the least recently used
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
    host = HostTier(LAYOUT, 2, pin=False, eviction="lru")
    a = put(host, key(0), 7)
    host.pin([key(0)])
    (b,) = host.reserve([key(1)])
    assert host.reserve([key(2)]) == [None]  # nothing left to evict
    host.commit([key(1)])
    (c,) = host.reserve([key(2)])  # evicts key 1, not the pinned key 0
    assert c == b and host.lookup(key(1)) is None
    assert host.lookup(key(0)) == a and bool((host.row(a) == 7).all())
    host.unpin([key(0)])
    host.commit([key(2)])
    host.touch([key(2)])
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


# -- memory grown in chunks ----------------------------------------------------------------

CHUNK = 2 * LAYOUT.nbytes  # two rows a chunk


class GatedAllocator:
    """Allocates a chunk only once the test opens its gate; records what it handed out."""

    def __init__(self, open_first: int = 1, fail_at: int | None = None) -> None:
        self.gates = [threading.Event() for _ in range(16)]
        for gate in self.gates[:open_first]:
            gate.set()
        self.fail_at = fail_at
        self.bytes: list[int] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        n = len(self.bytes)
        if not self.gates[n].wait(timeout=30):
            raise AssertionError("the test never opened the gate")
        if n == self.fail_at:
            raise RuntimeError("CUDA error: out of memory")
        self.bytes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    @property
    def allocated(self) -> int:
        return sum(self.bytes)


def growing(total: int, alloc: GatedAllocator) -> HostTier:
    return HostTier(
        LAYOUT,
        total,
        pin=False,
        chunk_bytes=CHUNK,
        background=True,
        allocate=alloc,
        eviction="lru",
    )


def assert_within_allocation(host: HostTier, alloc: GatedAllocator) -> None:
    assert host.capacity_blocks * LAYOUT.nbytes <= alloc.allocated
    assert host.stats().capacity_bytes == host.capacity_blocks * LAYOUT.nbytes


def test_the_tier_works_while_its_memory_grows() -> None:
    alloc = GatedAllocator()
    host = growing(6, alloc)
    try:
        # Usable at once, with only the first chunk: a third block evicts the least recent.
        assert host.capacity_blocks == 2 and host.target_blocks == 6
        assert_within_allocation(host, alloc)
        slots = [put(host, key(i), i) for i in range(2)]
        assert host.reserve([key(9)]) != [None] and host.stats().evictions == 1
        host.abort([key(9)])
        assert host.lookup(key(0)) is None and host.lookup(key(1)) == slots[1]
        alloc.gates[1].set()
        with host.memory.paused():  # waits out the chunk under way
            assert host.capacity_blocks == 4
            assert_within_allocation(host, alloc)
            new = [put(host, key(i), i) for i in (2, 3)]
            assert sorted(new) == [0, 2] and host.stats().evictions == 1  # room, no eviction
        for gate in alloc.gates:
            gate.set()
        assert host.memory.wait_full(timeout_s=30)
        assert host.capacity_blocks == 6 and len(host.memory.chunks) == 3
        assert_within_allocation(host, alloc)
        for i in (4, 5, 6):
            put(host, key(i), i)
        assert host.stats().evictions == 1  # the new chunk had room
        for i in range(1, 7):
            slot = host.lookup(key(i))
            assert slot is not None and bool((host.row(slot) == i).all())
    finally:
        host.close()


def test_growth_waits_while_paused() -> None:
    alloc = GatedAllocator(open_first=16)
    host = growing(8, alloc)
    try:
        with host.memory.paused():
            seen = host.capacity_blocks
            time.sleep(0.05)  # time for a running thread to grow, were it not paused
            assert host.capacity_blocks == seen == len(alloc.bytes) * 2
        assert host.memory.wait_full(timeout_s=30) and host.capacity_blocks == 8
    finally:
        host.close()


def test_a_pause_holds_every_host_tier_of_the_process() -> None:
    """Two engines in one process: while one captures CUDA graphs (paused), the other's tier may
    not pin either (a cudaHostRegister from any thread invalidates a capture: CUDA error 900, seen
    on an H200 with two LLMs in one test)."""
    first = growing(8, GatedAllocator(open_first=16))
    alloc = GatedAllocator(open_first=1)
    second = growing(8, alloc)
    try:
        assert first.memory.wait_full(timeout_s=30)
        # The second tier's thread is inside its next allocation, held at the gate: the pause
        # waits for it (opened shortly), then holds the rest.
        threading.Timer(0.1, alloc.gates[1].set).start()
        with first.memory.paused():
            seen = second.capacity_blocks
            for gate in alloc.gates:
                gate.set()
            time.sleep(0.1)  # time for its thread to grow, were it not paused
            assert second.capacity_blocks == seen == 4
        assert second.memory.wait_full(timeout_s=30) and second.capacity_blocks == 8
    finally:
        first.close()
        second.close()


def test_a_failed_allocation_keeps_what_was_allocated() -> None:
    alloc = GatedAllocator(open_first=16, fail_at=2)
    host = growing(8, alloc)
    assert not host.memory.wait_full(timeout_s=30)
    assert host.capacity_blocks == 4
    assert_within_allocation(host, alloc)
    for i in range(6):
        put(host, key(i), i)
    assert len(host) == 4 and host.stats().evictions == 2


def test_chunks_hold_whole_rows_and_copies_run_within_a_chunk() -> None:
    odd = BlockLayout(3, 1, 4, 4, "float32", "m")  # 384 bytes a block
    alloc = GatedAllocator(open_first=16)
    host = HostTier(odd, 7, pin=False, chunk_bytes=1024, allocate=alloc)
    assert host.memory.rows_per_chunk == 2  # whole rows only: 768 of 1024 bytes
    assert alloc.bytes == [768, 768, 768, 384] and host.capacity_blocks == 7
    runs = host.memory.runs([0, 1, 2, 3, 6], [10, 11, 12, 13, 20])
    assert [(r, g, n) for _, r, g, n in runs] == [(0, 10, 2), (0, 12, 2), (0, 20, 1)]
    with pytest.raises(IndexError):
        host.row(7)
    with pytest.raises(ValueError, match="chunk_bytes"):
        HostTier(odd, 7, pin=False, chunk_bytes=0)


def test_pinned_memory_dropped_without_close_is_unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine never closed: its host tier's pinned chunks are unregistered when the memory is
    collected, before their pages can be pinned again (on an H200 the next engine of the process
    failed with CUDA error 712, "already registered"); close() unpins once, not twice."""
    import gc

    from ember.kv.tiers import host_memory

    pinned: list[int] = []
    unpinned: list[int] = []

    monkeypatch.setattr(host_memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_memory.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(host_memory, "_host_register", lambda t: pinned.append(t.data_ptr()))
    monkeypatch.setattr(host_memory, "_host_unregister", lambda t: unpinned.append(t.data_ptr()))
    mem = host_memory.HostMemory(64, 8, pin=True, chunk_bytes=128, background=False)
    mem.wait_full()
    assert len(pinned) == 4 and not unpinned
    del mem
    gc.collect()
    assert not unpinned  # no CUDA call from a finalizer (it may run inside a graph capture)
    closed = host_memory.HostMemory(64, 2, pin=True, chunk_bytes=128, background=False)
    assert sorted(unpinned) == sorted(pinned[:4])  # unpinned before the next pinning
    closed.close()
    del closed
    gc.collect()
    assert len(unpinned) == 5  # the second memory's one chunk, at close, once


def test_the_growth_goes_at_the_pace_it_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "hold": no chunk; "idle": chunks without rests; "busy": a rest after each chunk. An engine
    sets it (held beside requests until its GPU cache evicts: pinning slowed them)."""
    from ember.kv.tiers import host_memory

    rests: list[float] = []
    sleep = time.sleep

    def rest(s: float) -> None:  # the growth thread's rests are recorded, not taken
        if threading.current_thread().name == "ember-kv-host":
            rests.append(s)
        else:
            sleep(s)

    monkeypatch.setattr(host_memory.time, "sleep", rest)
    alloc = GatedAllocator(open_first=16)
    host = HostTier(
        LAYOUT, 10, pin=False, chunk_bytes=CHUNK, background=True, allocate=alloc, pace="hold"
    )
    try:
        time.sleep(0.05)  # time to grow, were it not held
        assert host.capacity_blocks == 2 and len(alloc.bytes) == 1  # the first chunk only
        assert not host.memory.wait_full(timeout_s=0.05)
        host.memory.pace = "idle"
        deadline = time.monotonic() + 30
        while host.capacity_blocks < 6 and time.monotonic() < deadline:
            sleep(0.001)
        host.memory.pace = "hold"
        with host.memory.paused():  # waits out a chunk under way
            held = host.capacity_blocks
        assert held >= 6 and rests == []  # no rests while idle
        time.sleep(0.05)
        assert host.capacity_blocks == held  # held again
        host.memory.pace = "busy"
        assert host.memory.wait_full(timeout_s=30) and host.capacity_blocks == 10
        assert len(rests) == (10 - held) // 2 and all(r > 0 for r in rests)
    finally:
        host.close()


def test_a_memory_started_before_its_tier_hands_it_every_row() -> None:
    """An engine starts the host tier's memory before the tier exists (ember/engine/kv_tiers.py):
    the tier then counts the rows grown so far, and the chunks that come after."""
    from ember.kv.tiers.host_memory import HostMemory

    alloc = GatedAllocator(open_first=2)
    memory = HostMemory(LAYOUT.nbytes, 6, pin=False, chunk_bytes=CHUNK, background=True,
                        allocate=alloc)  # fmt: skip
    try:
        assert eventually(lambda: memory.num_rows == 4)
        host = HostTier(LAYOUT, 6, pin=False, memory=memory)
        assert host.capacity_blocks == 4
        assert sorted(put(host, key(i), i) for i in range(4)) == [0, 1, 2, 3]
        alloc.gates[2].set()
        assert memory.wait_full(timeout_s=30)
        assert host.capacity_blocks == 6 and host.stats().capacity_bytes == 6 * LAYOUT.nbytes
        assert sorted(put(host, key(i), i) for i in (4, 5)) == [4, 5]
        assert host.stats().evictions == 0
        with pytest.raises(ValueError, match="not 5 of"):
            HostTier(LAYOUT, 5, pin=False, memory=memory)
    finally:
        memory.close()


def test_pages_are_touched_by_every_thread() -> None:
    from ember.host_pages import advise_huge_pages
    from ember.kv.tiers.host_memory import _touch

    t = torch.full((3 * (1 << 20) + 7,), 7, dtype=torch.uint8)
    advise_huge_pages(t)  # a hint: nothing to see but that it does no harm
    _touch(t, 3)
    assert int(t.max()) == 0
    one = torch.full((5,), 1, dtype=torch.uint8)
    _touch(one, 4)  # more threads than bytes to share
    assert int(one.max()) == 0


def test_no_early_memory_on_the_cpu_and_a_misfit_one_is_closed(tmp_path) -> None:
    from ember.engine.config import EngineConfig
    from ember.engine.kv_tiers import build_tiers, start_host_memory
    from ember.kv.tiers.host_memory import HostMemory

    config = EngineConfig(model=str(tmp_path), kv_host_gb=0.001)
    assert start_host_memory(config, torch.device("cpu"), LAYOUT.nbytes, 64) is None
    cache = torch.zeros(3, 2, 2, 4, 2, 4)  # LAYOUT's blocks
    wrong = HostMemory(LAYOUT.nbytes + 1, 4, pin=False)
    tiers = build_tiers(config, cache, "m", 64, wrong)
    assert tiers is not None
    try:
        assert wrong._closed and tiers.host.memory is not wrong
        assert tiers.host.capacity_blocks == (1 << 30) // 1000 // LAYOUT.nbytes
    finally:
        tiers.close()


def test_the_engines_early_memory_is_the_tiers(tmp_path) -> None:
    """What a GPU engine starts before its weights load (ember/engine/kv_tiers.py) is the memory
    its host tier then uses: the same rows, not a second allocation. (On this CPU machine the
    memory is plain and allocated at once; on a GPU it is pinned in the background.)"""
    from ember.engine.config import EngineConfig
    from ember.engine.kv_tiers import build_tiers, start_host_memory

    config = EngineConfig(model=str(tmp_path), kv_host_gb=0.001)
    memory = start_host_memory(config, torch.device("cuda"), LAYOUT.nbytes, 64)
    assert memory is not None and memory.target_rows == (1 << 30) // 1000 // LAYOUT.nbytes
    assert memory.pace == "idle"  # grows while the engine starts
    tiers = build_tiers(config, torch.zeros(3, 2, 2, 4, 2, 4), "m", 64, memory)
    assert tiers is not None
    try:
        assert tiers.host.memory is memory and not memory._closed
        assert tiers.host.capacity_blocks == memory.num_rows == memory.target_rows
    finally:
        tiers.close()
    off = EngineConfig(model=str(tmp_path), kv_host_gb=0)
    assert start_host_memory(off, torch.device("cuda"), LAYOUT.nbytes, 64) is None
