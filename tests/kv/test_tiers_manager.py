"""The tier manager on CPU: offloads down to host, disk and a fake store, loads back up, faults."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from ember.kv.tiers.base import BlockLayout, Medium, Tier, TierHit, TierStats, check_rows
from ember.kv.tiers.cost import CostModel
from ember.kv.tiers.disk import HEADER, DiskTier
from ember.kv.tiers.host import HostTier
from ember.kv.tiers.manager import TierManager

LAYOUT = BlockLayout(
    num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32", model="m"
)
NBYTES = LAYOUT.nbytes


class MemoryStore(Tier):
    """A store in a dict, as the Mooncake store tier would behave on a healthy cluster."""

    medium: Medium = "store"

    def __init__(self) -> None:
        self.data: dict[bytes, torch.Tensor] = {}
        self._stats = TierStats()

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.data:
            n += 1
        return n

    def put(self, keys: Sequence[bytes], src: torch.Tensor) -> list[bool]:
        check_rows(src, len(keys), NBYTES, "src")
        for i, k in enumerate(keys):
            self.data[k] = src[i].clone()
        self._stats.blocks_in += len(keys)
        return [True] * len(keys)

    def get_into(self, keys: Sequence[bytes], dst: torch.Tensor) -> list[bool]:
        check_rows(dst, len(keys), NBYTES, "dst")
        out = []
        for i, k in enumerate(keys):
            if k in self.data:
                dst[i].copy_(self.data[k])
            out.append(k in self.data)
        self._stats.hits += sum(out)
        return out

    def stats(self) -> TierStats:
        return self._stats.copy()


class DownStore(MemoryStore):
    """A store whose master is unreachable: every call raises."""

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        raise ConnectionError("mooncake master unreachable")

    def put(self, keys: Sequence[bytes], src: torch.Tensor) -> list[bool]:
        raise ConnectionError("mooncake master unreachable")

    def get_into(self, keys: Sequence[bytes], dst: torch.Tensor) -> list[bool]:
        raise ConnectionError("mooncake master unreachable")


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def gpu(n: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, NBYTES), dtype=torch.uint8, generator=g)


@pytest.fixture
def managers() -> Iterator[list[TierManager]]:
    made: list[TierManager] = []
    yield made
    for m in made:
        m.close(wait=False)


def make(
    made: list[TierManager],
    gpu_blocks: torch.Tensor,
    lower: list[Tier],
    host_blocks: int = 8,
    **kw: object,
) -> TierManager:
    cost = CostModel(LAYOUT, bandwidth={"cpu": 1.0, "disk": 1.0, "store": 1.0})
    # Two blocks a chunk: every copy between GPU and host crosses chunks of the host's memory.
    # LRU: these tests name which block an eviction takes (the policies have tests of their own).
    host = HostTier(LAYOUT, host_blocks, pin=True, chunk_bytes=2 * NBYTES, eviction="lru")
    m = TierManager(LAYOUT, gpu_blocks, host, lower, cost, **kw)  # type: ignore[arg-type]
    made.append(m)
    return m


def load(m: TierManager, load_id: str, keys: list[bytes], ids: list[int]) -> int:
    m.start_load(load_id, keys, ids)
    m.flush()
    done = m.poll_loads()
    assert done == [(load_id, done[0][1])]
    return done[0][1]


def test_offload_then_load_from_host_is_byte_identical(managers: list[TierManager]) -> None:
    g = gpu()
    m = make(managers, g, [])
    keys = [key(i) for i in range(4)]
    m.offload([(i, k) for i, k in enumerate(keys)])
    assert m.lookup(keys) == TierHit()  # copies wait for the step to be done
    m.step_done()
    assert m.lookup(keys) == TierHit(host=4)
    assert load(m, "r1", keys, [10, 11, 12, 13]) == 4
    assert torch.equal(g[10:14], g[0:4])
    s = m.stats()["cpu"]
    assert (s.blocks_in, s.hits, s.blocks_out, s.occupancy_blocks) == (4, 4, 4, 4)
    assert all(not m.host.is_pinned(k) for k in keys)
    assert m.cost.bandwidth("cpu") > 1.0  # measured on the copy


def test_round_trip_gpu_host_disk_store_gpu(tmp_path: Path, managers: list[TierManager]) -> None:
    g = gpu()
    original = g[0:4].clone()
    store = MemoryStore()
    keys = [key(i) for i in range(4)]
    first = make(managers, g, [DiskTier(tmp_path / "a", 1 << 20, LAYOUT), store])
    first.offload([(i, k) for i, k in enumerate(keys)])
    first.step_done()
    first.flush()
    assert set(store.data) == set(keys)
    # A second engine: empty host, its own disk holds the first two blocks, the store all four.
    g2 = gpu(seed=1)
    disk2 = DiskTier(tmp_path / "b", 1 << 20, LAYOUT)
    disk2.put(keys[:2], original[:2].clone())
    second = make(managers, g2, [disk2, store])
    hit = second.lookup(keys)
    assert hit == TierHit(disk=2, store=2)
    assert load(second, "r", keys, [3, 5, 7, 9]) == 4
    assert torch.equal(g2[[3, 5, 7, 9]], original)
    # The loaded blocks are now in this engine's host tier: the next turn hits there.
    assert second.lookup(keys) == TierHit(host=4)
    assert second.cost.bandwidth("disk") > 1.0 and second.cost.bandwidth("store") > 1.0


def test_host_disk_store_prefix_continues_tier_by_tier(
    tmp_path: Path, managers: list[TierManager]
) -> None:
    g = gpu()
    store = MemoryStore()
    disk = DiskTier(tmp_path, 1 << 20, LAYOUT)
    m = make(managers, g, [disk, store])
    keys = [key(i) for i in range(7)]
    m.offload([(0, keys[0]), (1, keys[1])])
    m.step_done()
    m.flush()
    disk.put(keys[2:4], g[2:4].clone())
    store.put(keys[4:6], g[4:6].clone())
    assert m.lookup(keys) == TierHit(host=2, disk=2, store=2)
    assert m.lookup(keys[1:]) == TierHit(host=1, disk=2, store=2)
    assert m.lookup(keys[6:]) == TierHit()


def test_corrupt_disk_entry_truncates_the_load(tmp_path: Path, managers: list[TierManager]) -> None:
    g = gpu()
    disk = DiskTier(tmp_path, 1 << 20, LAYOUT)
    keys = [key(i) for i in range(3)]
    disk.put(keys, g[0:3].clone())
    path = disk.path_of(keys[1])
    data = bytearray(path.read_bytes())
    data[HEADER.size + 40] ^= 1
    path.write_bytes(bytes(data))
    m = make(managers, g, [disk])
    assert m.lookup(keys) == TierHit(disk=3)  # found by name; the damage shows on read
    assert load(m, "r", keys, [8, 9, 10]) == 1
    assert torch.equal(g[8], g[0])
    assert m.lookup(keys) == TierHit(host=1)  # the damaged entry is gone, the rest is not read
    assert m.stats()["disk"].corrupt == 1
    assert not any(m.host.holds(k) for k in keys[1:])  # reservations given back


def test_a_store_that_raises_is_a_miss_never_an_error(managers: list[TierManager]) -> None:
    g = gpu()
    m = make(managers, g, [DownStore()])
    keys = [key(i) for i in range(3)]
    assert m.lookup(keys) == TierHit()
    m.offload([(i, k) for i, k in enumerate(keys)])
    m.step_done()
    m.flush()
    assert m.lookup(keys) == TierHit(host=3)  # the host tier still works
    other = [key(i) for i in range(10, 12)]
    assert load(m, "r", other, [5, 6]) == 0
    s = m.stats()["store"]
    assert s.errors >= 3 and s.drops == 3 and s.misses == 2


def test_write_backlog_full_drops_and_counts(tmp_path: Path, managers: list[TierManager]) -> None:
    g = gpu()
    disk = DiskTier(tmp_path, 1 << 20, LAYOUT)
    m = make(managers, g, [disk], max_pending_writes=0)
    m.offload([(0, key(0)), (1, key(1))])
    m.step_done()
    m.flush()
    assert m.lookup([key(0), key(1)]) == TierHit(host=2)
    assert disk.contains_prefix([key(0)]) == 0
    assert m.stats()["disk"].drops == 2
    assert not m.host.is_pinned(key(0))


def test_offload_skips_known_keys_and_drops_what_does_not_fit(managers: list[TierManager]) -> None:
    g = gpu()
    m = make(managers, g, [], host_blocks=2)
    m.offload([(0, key(0)), (0, key(0))])
    m.step_done()
    m.offload([(0, key(0)), (1, key(1))])
    m.step_done()
    assert m.stats()["cpu"].blocks_in == 2
    m.start_load("pin-both", [key(0), key(1)], [4, 5])  # pinned until polled
    m.offload([(2, key(2))])
    m.step_done()
    s = m.stats()["cpu"]
    assert s.drops == 1 and s.evictions == 0 and not m.host.holds(key(2))
    assert m.poll_loads() == [("pin-both", 2)]


def test_cancel_releases_the_host_side(tmp_path: Path, managers: list[TierManager]) -> None:
    g = gpu()
    disk = DiskTier(tmp_path, 1 << 20, LAYOUT)
    keys = [key(i) for i in range(3)]
    disk.put(keys, g[0:3].clone())
    m = make(managers, g, [disk], host_blocks=3)
    m.start_load("r", keys, [5, 6, 7])
    m.cancel("r")
    m.flush()
    assert m.poll_loads() == []
    assert m.num_loading == 0
    assert not any(m.host.is_pinned(k) for k in keys)
    # Every slot is free to reuse.
    assert all(s is not None for s in m.host.reserve([key(i) for i in range(20, 23)]))


def test_host_to_gpu_only_loads_the_prefix_still_in_host(managers: list[TierManager]) -> None:
    g = gpu()
    m = make(managers, g, [], host_blocks=4)
    keys = [key(i) for i in range(3)]
    m.offload([(0, keys[0]), (2, keys[2])])
    m.step_done()
    assert load(m, "r", keys, [8, 9, 10]) == 1
    assert torch.equal(g[8], g[0])


def test_decisions_are_counted_per_tier(tmp_path: Path, managers: list[TierManager]) -> None:
    m = make(managers, gpu(), [DiskTier(tmp_path, 1 << 20, LAYOUT)])
    m.cost = CostModel(LAYOUT, bandwidth={"cpu": 1e12, "disk": 1e12})
    hit = TierHit(host=2, disk=3)
    assert m.should_load(hit, prefill_tok_s=1.0)
    assert not m.should_load(hit, prefill_tok_s=1e12)
    assert m.plan(hit, prefill_tok_s=1.0) == hit
    assert m.plan(hit, prefill_tok_s=1e12) == TierHit()
    s = m.stats()  # deciding is not counting: a waiting request is planned again each step
    assert (s["cpu"].loads, s["cpu"].recomputes) == (0, 0)
    m.count_decision(hit, hit)
    m.count_decision(hit, TierHit(host=2))  # the host part loaded, the disk part recomputed
    m.count_decision(hit, TierHit())
    s = m.stats()
    assert (s["cpu"].loads, s["cpu"].recomputes) == (2, 1)
    assert (s["disk"].loads, s["disk"].recomputes) == (1, 2)
    assert s["cpu"].loads + s["cpu"].recomputes == 3


def test_bad_calls_are_refused(managers: list[TierManager]) -> None:
    m = make(managers, gpu(4), [])
    with pytest.raises(ValueError, match="outside"):
        m.offload([(4, key(0))])
    with pytest.raises(ValueError, match="2 keys but 1"):
        m.start_load("r", [key(0), key(1)], [0])
    m.start_load("r", [key(0)], [0])
    with pytest.raises(ValueError, match="already running"):
        m.start_load("r", [key(0)], [1])
    with pytest.raises(ValueError, match="layouts differ"):
        TierManager(LAYOUT, gpu(4)[:, :8], HostTier(LAYOUT, 2, pin=False), [], CostModel(LAYOUT))
    with pytest.raises(ValueError, match="at most one disk"):
        TierManager(
            LAYOUT,
            gpu(4),
            HostTier(LAYOUT, 2, pin=False),
            [MemoryStore(), MemoryStore()],
            CostModel(LAYOUT),
        )


def test_a_load_into_a_block_still_being_offloaded_waits_for_the_copy(
    managers: list[TierManager],
) -> None:
    """A request ends right after its block was offloaded; the freed block goes to a load at once.
    The offload must copy the block's old bytes, not the loaded ones."""
    g = gpu()
    m = make(managers, g, [])
    m.offload([(1, key(1))])
    m.step_done()
    old = g[0].clone()
    m.offload([(0, key(0))])  # still pending: no step_done yet
    m.start_load("r", [key(1)], [0])
    assert m.poll_loads() == [("r", 1)]
    assert torch.equal(g[0], g[1])
    m.step_done()
    slot = m.host.lookup(key(0))
    assert slot is not None and torch.equal(m.host.row(slot), old)


# -- CUDA: side streams, events, fences ----------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BIG = BlockLayout(
    num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16", model="m"
)


def _busy_gpu() -> None:
    """Queue some milliseconds of work on the current stream, so copies behind it wait."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a
        a = a / a.norm()


def _poll_until(m: TierManager, load_id: str) -> int:
    for _ in range(1000):
        for got, n in m.poll_loads():  # the first poll starts the copy: no sync before it
            assert got == load_id
            return n
        torch.cuda.synchronize()
    raise AssertionError(f"load {load_id} never ended")


@pytest.mark.gpu
@needs_cuda
def test_cuda_round_trip_through_host_and_disk(tmp_path: Path) -> None:
    n = 16
    g = torch.zeros(2 * n, BIG.nbytes, dtype=torch.uint8, device="cuda")
    src = torch.randint(0, 256, (n, BIG.nbytes), dtype=torch.uint8, device="cuda")
    keys = [key(i) for i in range(n)]
    disk = DiskTier(tmp_path, 1 << 30, BIG)
    m = TierManager(BIG, g, HostTier(BIG, 2 * n, pin=True), [disk], CostModel(BIG))
    try:
        assert m.host.memory.pinned and m.host.row(0).is_pinned()
        _busy_gpu()
        g[:n].copy_(src)  # "the step" writes the blocks
        step = torch.cuda.Event()
        step.record()
        m.offload([(i, k) for i, k in enumerate(keys)], after=step)
        m.step_done()  # does not wait for the GPU
        m.flush()
        assert m.lookup(keys) == TierHit(host=n)
        assert disk.contains_prefix(keys) == n
        assert _load_cuda(m, "host", keys, list(range(n, 2 * n))) == n
        assert torch.equal(g[n:], src)
    finally:
        m.close()
    # A fresh engine: empty host, the disk from before.
    g2 = torch.zeros(n, BIG.nbytes, dtype=torch.uint8, device="cuda")
    m2 = TierManager(
        BIG, g2, HostTier(BIG, n, pin=True), [DiskTier(tmp_path, 1 << 30, BIG)], CostModel(BIG)
    )
    try:
        assert m2.lookup(keys) == TierHit(disk=n)
        assert _load_cuda(m2, "disk", keys, list(reversed(range(n)))) == n
        assert torch.equal(g2.flip(0), src)
        assert m2.cost.bandwidth("cpu") != CostModel(BIG).bandwidth("cpu")  # measured by events
    finally:
        m2.close()


def _load_cuda(m: TierManager, load_id: str, keys: list[bytes], ids: list[int]) -> int:
    m.start_load(load_id, keys, ids)
    m.flush()
    return _poll_until(m, load_id)


@pytest.mark.gpu
@needs_cuda
def test_cuda_load_into_a_block_being_offloaded_waits_for_the_copy() -> None:
    n = 64
    g = torch.full((n + 1, BIG.nbytes), 7, dtype=torch.uint8, device="cuda")
    m = TierManager(BIG, g, HostTier(BIG, n + 1, pin=True), [], CostModel(BIG))
    try:
        g[n].fill_(11)
        m.offload([(n, key(n))])
        m.flush()
        _busy_gpu()
        step = torch.cuda.Event()
        step.record()
        # A request's last blocks, block 0 copied out last; the request ends and its freed
        # block 0 goes straight to a load.
        m.offload([(i, key(i)) for i in reversed(range(n))], after=step)
        m.start_load("r", [key(n)], [0])
        assert _poll_until(m, "r") == 1
        m.flush()
        slot = m.host.lookup(key(0))
        assert slot is not None and bool((m.host.row(slot) == 7).all())
        assert bool((g[0] == 11).all())
    finally:
        m.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_fence_orders_a_write_after_the_copy_out() -> None:
    n = 64
    g = torch.full((n, BIG.nbytes), 3, dtype=torch.uint8, device="cuda")
    m = TierManager(BIG, g, HostTier(BIG, n, pin=True), [], CostModel(BIG))
    try:
        _busy_gpu()
        step = torch.cuda.Event()
        step.record()
        # Block 0 is copied last, well after the compute stream is free again.
        m.offload([(i, key(i)) for i in reversed(range(n))], after=step)
        m.fence([0])
        g[0].fill_(9)  # the next step reuses block 0
        m.flush()
        slot = m.host.lookup(key(0))
        assert slot is not None and bool((m.host.row(slot) == 3).all())
    finally:
        m.close()


def test_tier_events_follow_host_and_disk(managers: list[TierManager], tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 2 * (HEADER.size + 32 + NBYTES), LAYOUT, eviction="lru")
    m = make(managers, gpu(), [disk], host_blocks=2, record_events=True, max_pending_writes=8)
    m.offload([(0, key(0)), (1, key(1))])
    m.flush()
    assert sorted(m.drain_events()) == sorted(
        [("stored", key(i), medium) for i in (0, 1) for medium in ("cpu", "disk")]
    )
    assert m.drain_events() == []
    m.offload([(2, key(2))])  # the host and the disk hold two: key 0 leaves both
    m.flush()
    events = m.drain_events()
    assert sorted(events) == sorted(
        [
            (kind, k, medium)
            for kind, k in (("removed", key(0)), ("stored", key(2)))
            for medium in ("cpu", "disk")
        ]
    )
    path = disk.path_of(key(1))
    path.write_bytes(path.read_bytes()[:-1])  # truncated: a load finds it corrupt and deletes it
    m.host.reserve([key(9)])  # (host entries are never corrupt: evict key 1 from host first)
    m.host.abort([key(9)])
    assert ("removed", key(1), "cpu") in m.drain_events()
    assert load(m, "r", [key(1)], [5]) == 0
    assert ("removed", key(1), "disk") in m.drain_events()


def test_tier_events_are_off_unless_asked(managers: list[TierManager]) -> None:
    m = make(managers, gpu(), [], host_blocks=1)
    for i in range(2):
        m.offload([(i, key(i))])
        m.flush()
    assert m.stats()["cpu"].evictions == 1 and m.drain_events() == []
