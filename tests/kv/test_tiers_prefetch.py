"""Store lookups ahead of admission (ember/kv/tiers/prefetch.py): the store is asked in a background
thread as soon as a request arrives, never by the engine thread at scheduling; an answer that is
late past the grace is a miss; the table of answers is bounded and forgotten on admission. The
disk and store blocks worth loading are then read into host ahead of admission, bounded."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from ember.kv.tiers.base import Counters, Medium, Tier, TierHit
from ember.kv.tiers.cost import CostModel
from ember.kv.tiers.disk import DiskTier
from ember.kv.tiers.host import HostTier
from ember.kv.tiers.manager import TierManager
from ember.kv.tiers.prefetch import LookupPrefetch
from tests.kv.test_tiers_manager import LAYOUT, MemoryStore, gpu, key, make


class SlowStore(MemoryStore):
    """A store on a master that answers only when the test says (as a slow or dead one would
    after seconds); it records the threads that asked it."""

    lookup_may_wait = True

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.asked_from: list[int] = []

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        self.asked_from.append(threading.get_ident())
        self.release.wait(30)
        return [k in self.data for k in keys]

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        self.asked_from.append(threading.get_ident())
        self.release.wait(30)
        return super().contains_prefix(keys)


def eventually(check: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Poll until `check()` holds; a bound on waiting, not a measurement."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def managers() -> Iterator[list[TierManager]]:
    made: list[TierManager] = []
    yield made
    for m in made:
        m.close(wait=False)


@pytest.fixture
def store() -> Iterator[SlowStore]:
    s = SlowStore()
    yield s
    s.release.set()


def test_scheduling_never_asks_the_store(managers: list[TierManager], store: SlowStore) -> None:
    m = make(managers, gpu(), [store], lookup_grace_s=60.0)
    keys = [key(i) for i in range(4)]
    store.data.update({k: torch.zeros(1) for k in keys})
    m.prefetch("r", keys)
    assert m.lookup(keys, "r") is None  # the answer is out, within the grace: ask next step
    store.release.set()
    assert eventually(lambda: m.lookup(keys, "r") is not None)
    assert m.lookup(keys, "r") == TierHit(store=4)
    assert m.lookup(keys[1:], "r") == TierHit(store=3)  # past a GPU hit: the same answer
    assert store.asked_from and threading.get_ident() not in store.asked_from
    m.forget("r")
    assert len(m.prefetches) == 0


def test_a_lookup_late_past_the_grace_is_a_miss(
    tmp_path: Path, managers: list[TierManager], store: SlowStore
) -> None:
    disk = DiskTier(tmp_path, 1 << 20, LAYOUT)
    m = make(managers, gpu(), [disk, store], lookup_grace_s=0.0)
    keys = [key(i) for i in range(4)]
    disk.put(keys[:1], gpu(1))
    store.data.update({k: torch.zeros(1) for k in keys})
    m.prefetch("r", keys)
    assert m.lookup(keys, "r") == TierHit(disk=1)  # decided without the store
    assert threading.get_ident() not in store.asked_from


def test_a_pending_lookup_holds_nothing_that_host_and_disk_cover(
    tmp_path: Path, managers: list[TierManager], store: SlowStore
) -> None:
    disk = DiskTier(tmp_path, 1 << 20, LAYOUT)
    m = make(managers, gpu(), [disk, store], lookup_grace_s=60.0)
    keys = [key(i) for i in range(3)]
    disk.put(keys, gpu(3))
    m.prefetch("r", keys)
    assert m.lookup(keys, "r") == TierHit(disk=3)  # the store could add nothing: no wait


def test_the_store_continues_past_a_gap_it_has(
    managers: list[TierManager], store: SlowStore
) -> None:
    """The store may have evicted the first blocks (served from host since): the answer is per
    key, so the store still continues where the host stops."""
    store.release.set()
    g = gpu()
    m = make(managers, g, [store], lookup_grace_s=60.0)
    keys = [key(i) for i in range(6)]
    m.offload([(0, keys[0]), (1, keys[1])])
    m.step_done()
    m.flush()
    for k in keys[:2]:
        del store.data[k]  # written through, then evicted by the store
    store.put(keys[2:], g[2:6].clone())
    m.prefetch("r", keys)
    assert eventually(lambda: m.lookup(keys, "r") is not None)
    assert m.lookup(keys, "r") == TierHit(host=2, store=4)


def test_the_table_is_bounded_and_a_failed_lookup_is_a_miss() -> None:
    class Broken(MemoryStore):
        lookup_may_wait = True

        def present(self, keys: Sequence[bytes]) -> list[bool]:
            raise ConnectionError("mooncake master unreachable")

    counters = Counters(["cpu", "store"])
    p = LookupPrefetch([Broken()], counters, grace_s=60.0, max_lookups=2)
    try:
        for rid in ("a", "b", "c"):
            p.start(rid, [key(0)])
        assert len(p) == 2
        assert p.result("c") == {}  # no room: no answer, a miss
        assert eventually(lambda: p.result("a") is not None)
        assert p.result("a") == {"store": frozenset()}
        assert counters.merged("store", MemoryStore().stats()).errors >= 1
        p.forget("a")
        p.start("c", [key(0)])
        assert len(p) == 2 and p.result("a") == {}
    finally:
        p.close()


def test_no_slow_tier_means_no_thread(tmp_path: Path) -> None:
    p = LookupPrefetch([DiskTier(tmp_path, 1 << 20, LAYOUT)], Counters(["cpu", "disk"]))
    p.start("a", [key(0)])
    assert not p and len(p) == 0 and p.result("a") == {}
    p.close()


def test_a_tier_that_may_wait_defaults_to_its_prefix() -> None:
    store = MemoryStore()
    store.data.update({key(0): torch.zeros(1), key(2): torch.zeros(1)})
    assert Tier.present(store, [key(0), key(1), key(2)]) == [True, False, False]


# -- blocks read into host ahead of admission ------------------------------------------------------


class GatedDisk(MemoryStore):
    """A disk whose reads end only when the test says (a slow device); lookups answer at once."""

    medium: Medium = "disk"

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def get_into(self, keys: Sequence[bytes], dst: torch.Tensor) -> list[bool]:
        self.gate.wait(30)
        return super().get_into(keys, dst)


def loading(
    made: list[TierManager], g: torch.Tensor, lower: list[Tier], **kw: object
) -> TierManager:
    """A manager whose cost model always prefers loading to recomputing."""
    cost = CostModel(LAYOUT, prefill_tok_s=1.0)
    host = HostTier(LAYOUT, 8, pin=False)
    m = TierManager(LAYOUT, g, host, lower, cost, **kw)  # type: ignore[arg-type]
    made.append(m)
    return m


def test_disk_blocks_reach_host_as_the_request_arrives(
    tmp_path: Path, managers: list[TierManager]
) -> None:
    g = gpu()
    disk = DiskTier(tmp_path, 1 << 20, LAYOUT)
    keys = [key(i) for i in range(4)]
    disk.put(keys, g[:4].clone())
    m = loading(managers, torch.zeros_like(g), [disk])
    m.prefetch("r", keys)
    m.forget("r")  # the request ended: what was read stays in host, harmless
    m.lower.join()
    assert m.host.contains_prefix(keys) == 4
    assert m.lookup(keys, "again") == TierHit(host=4)
    assert m.stats()["disk"].prefetched == 4
    for i, k in enumerate(keys):
        slot = m.host.lookup(k)
        assert slot is not None and torch.equal(m.host.row(slot), g[i])


def test_blocks_worth_recomputing_are_not_read(tmp_path: Path, managers: list[TierManager]) -> None:
    disk = DiskTier(tmp_path, 1 << 20, LAYOUT)
    keys = [key(i) for i in range(4)]
    disk.put(keys, gpu(4))
    m = make(managers, gpu(), [disk])  # reads at one byte a second: recomputing wins
    m.prefetch("r", keys)
    m.lower.join()
    assert m.host.contains_prefix(keys) == 0 and m.stats()["disk"].prefetched == 0


def test_store_blocks_are_read_once_its_answer_is_in(
    managers: list[TierManager], store: SlowStore
) -> None:
    g = gpu()
    keys = [key(i) for i in range(4)]
    store.put(keys, g[:4].clone())
    m = loading(managers, torch.zeros_like(g), [store], lookup_grace_s=60.0)
    m.prefetch("r", keys)
    assert m.lookup(keys, "r") is None
    store.release.set()
    assert eventually(lambda: m.lookup(keys, "r") is not None)
    assert m.lookup(keys, "r") == TierHit(host=4)
    assert m.stats()["store"].prefetched == 4
    assert threading.get_ident() not in store.asked_from


def test_prefetches_in_flight_are_bounded_and_admission_waits_for_them(
    managers: list[TierManager],
) -> None:
    disk = GatedDisk()
    a, b = [key(i) for i in range(2)], [key(i) for i in range(10, 12)]
    disk.put(a + b, gpu(4))
    m = loading(managers, gpu(), [disk], max_prefetch_blocks=3)
    try:
        m.prefetch("a", a)
        m.prefetch("b", b)  # 2 + 2 blocks would pass the limit of 3: skipped
        assert m.lookup(a, "a") is None  # being read: a load now would find them reserved
        assert m.lookup(b, "b") == TierHit(disk=2)
    finally:
        disk.gate.set()
    m.lower.join()
    assert m.lookup(a, "a") == TierHit(host=2)
    assert m.host.contains_prefix(b) == 0
    assert m.stats()["disk"].prefetched == 2
    m.prefetch("b", b)  # room again
    m.lower.join()
    assert m.host.contains_prefix(b) == 2


def test_a_prefetch_never_evicts_pinned_entries(
    tmp_path: Path, managers: list[TierManager]
) -> None:
    g = gpu()
    m = loading(managers, g, [DiskTier(tmp_path, 1 << 20, LAYOUT)], max_prefetch_blocks=8)
    held = [key(i) for i in range(6)]
    m.offload(list(enumerate(held)))
    m.step_done()
    m.flush()
    m.host.pin(held)
    wanted = [key(i) for i in range(20, 24)]
    m.lower.tiers[0].put(wanted, g[6:10].clone())
    m.prefetch("r", wanted)  # two free slots of eight: only the first two are read
    m.lower.join()
    assert m.host.contains_prefix(held) == 6
    assert m.host.contains_prefix(wanted) == 2
    assert m.stats()["disk"].prefetched == 2
    m.host.unpin(held)
