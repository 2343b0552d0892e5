"""Hypothesis state machines over the host and disk tiers, and over the tier manager: capacity is
kept, pinned (in-use) entries are never evicted, and an entry always holds what was put under its key."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ember.kv.tiers.base import BlockLayout
from ember.kv.tiers.cost import CostModel
from ember.kv.tiers.disk import HEADER, DiskTier
from ember.kv.tiers.host import HostTier
from ember.kv.tiers.manager import TierManager

LAYOUT = BlockLayout(
    num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32", model="m"
)
NBYTES = LAYOUT.nbytes  # 128: four copies of a 32-byte key
ENTRY = HEADER.size + 32 + NBYTES
HOST_BLOCKS = 4
DISK_BLOCKS = 5
GPU_BLOCKS = 4

key_ids = st.integers(0, 11)


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def content(k: bytes) -> torch.Tensor:
    """What a block stored under `k` must hold: the key itself, repeated."""
    return torch.frombuffer(bytearray(k * (NBYTES // len(k))), dtype=torch.uint8)


class HostAndDisk(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ember-tiers-"))
        self.host = HostTier(LAYOUT, HOST_BLOCKS, pin=False, chunk_bytes=2 * NBYTES)
        self.disk = DiskTier(self.dir, DISK_BLOCKS * ENTRY, LAYOUT)
        self.pins: dict[bytes, int] = {}
        self.reserved: set[bytes] = set()
        self.damaged: set[bytes] = set()

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- host ------------------------------------------------------------------------------

    @rule(i=key_ids, commit=st.booleans())
    def host_write(self, i: int, commit: bool) -> None:
        k = key(i)
        present = self.host.holds(k)
        (slot,) = self.host.reserve([k])
        if present:
            assert slot is None
            return
        if slot is None:  # no room: everything else is pinned or reserved
            assert len(self.pins) + len(self.reserved) >= HOST_BLOCKS
            return
        self.host.row(slot).copy_(content(k))
        if commit:
            self.host.commit([k])
        else:
            self.reserved.add(k)

    @precondition(lambda self: self.reserved)
    @rule(data=st.data(), commit=st.booleans())
    def host_finish(self, data: st.DataObject, commit: bool) -> None:
        k = data.draw(st.sampled_from(sorted(self.reserved)))
        self.reserved.discard(k)
        (self.host.commit if commit else self.host.abort)([k])
        if not commit and k in self.pins:
            del self.pins[k]  # an aborted entry's pins go with it

    @rule(i=key_ids)
    def host_pin(self, i: int) -> None:
        k = key(i)
        if self.host.holds(k):
            self.host.pin([k])
            self.pins[k] = self.pins.get(k, 0) + 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def host_unpin(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(self.pins)))
        self.host.unpin([k])
        self.pins[k] -= 1
        if not self.pins[k]:
            del self.pins[k]

    @rule(i=key_ids)
    def host_read(self, i: int) -> None:
        k = key(i)
        slot = self.host.lookup(k)
        if slot is not None:
            assert torch.equal(self.host.row(slot), content(k))

    # -- disk ------------------------------------------------------------------------------

    @rule(i=key_ids)
    def disk_put(self, i: int) -> None:
        k = key(i)
        assert self.disk.put([k], content(k).unsqueeze(0).clone()) == [True]
        assert self.disk.contains_prefix([k]) == 1

    @rule(i=key_ids)
    def disk_read(self, i: int) -> None:
        k = key(i)
        dst = torch.zeros(1, NBYTES, dtype=torch.uint8)
        known = self.disk.contains_prefix([k]) == 1
        (ok,) = self.disk.get_into([k], dst)
        if k in self.damaged:
            assert not ok and self.disk.contains_prefix([k]) == 0
            self.damaged.discard(k)
        else:
            assert ok == known
        if ok:
            assert torch.equal(dst[0], content(k))

    @rule(i=key_ids, offset=st.integers(0, ENTRY - 1), cut=st.booleans())
    def disk_damage(self, i: int, offset: int, cut: bool) -> None:
        k = key(i)
        path = self.disk.path_of(k)
        if k in self.damaged or self.disk.contains_prefix([k]) == 0:
            return
        data = bytearray(path.read_bytes())
        if cut:
            data = data[:offset]
        else:
            data[offset] ^= 0x01
        path.write_bytes(bytes(data))
        self.damaged.add(k)

    @rule()
    def disk_restart(self) -> None:
        before = {i for i in range(12) if self.disk.contains_prefix([key(i)])}
        self.disk = DiskTier(self.dir, DISK_BLOCKS * ENTRY, LAYOUT)
        after = {i for i in range(12) if self.disk.contains_prefix([key(i)])}
        assert after <= before
        # A damaged header is caught at start-up, a damaged payload only when read.
        assert before - after <= {i for i in range(12) if key(i) in self.damaged}
        self.damaged = {k for k in self.damaged if self.disk.contains_prefix([k])}

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def within_capacity(self) -> None:
        h, d = self.host.stats(), self.disk.stats()
        assert h.occupancy_blocks <= HOST_BLOCKS and h.occupancy_bytes <= h.capacity_bytes
        assert d.occupancy_bytes <= d.capacity_bytes == DISK_BLOCKS * ENTRY
        # A file whose fingerprint was damaged reads as another layout's: left alone, not counted.
        assert d.occupancy_blocks <= sum(1 for _ in self.dir.rglob("*.kv"))
        indexed = [key(i) for i in range(12) if self.disk.contains_prefix([key(i)])]
        assert len(indexed) == d.occupancy_blocks
        assert all(self.disk.path_of(k).exists() for k in indexed)

    @invariant()
    def pinned_and_reserved_stay(self) -> None:
        for k in self.pins:
            assert self.host.holds(k)
        for k in self.reserved:
            assert self.host.holds(k) and self.host.lookup(k) is None


class Manager(RuleBasedStateMachine):
    """The tier manager with a disk below: blocks of a load are never evicted from the host while
    it runs, and whatever a load reports lands in the GPU blocks byte for byte."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ember-tiers-"))
        self.gpu = torch.zeros(GPU_BLOCKS, NBYTES, dtype=torch.uint8)
        self.gpu_key: dict[int, bytes] = {}  # what each GPU block holds, once written
        self.m = TierManager(
            LAYOUT,
            self.gpu,
            HostTier(LAYOUT, HOST_BLOCKS, pin=False, chunk_bytes=2 * NBYTES),
            [DiskTier(self.dir, DISK_BLOCKS * ENTRY, LAYOUT)],
            CostModel(LAYOUT),
        )
        self.loads: dict[str, tuple[list[bytes], list[int]]] = {}
        self.n = 0

    def teardown(self) -> None:
        self.m.close(wait=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def free_gpu(self, order: list[int]) -> list[int]:
        """GPU blocks in `order` that no running load writes into."""
        busy = {b for _, ids in self.loads.values() for b in ids}
        return [b for b in order if b not in busy]

    # The background thread decides when a write lands and a load ends: draw the same shape of
    # data whatever it did, so hypothesis can replay a run.
    @rule(order=st.permutations(range(GPU_BLOCKS)), ids=st.lists(key_ids, min_size=1, max_size=3))
    def compute_and_offload(self, order: list[int], ids: list[int]) -> None:
        blocks = self.free_gpu(order)[: len(ids)]
        ids = ids[: len(blocks)]
        self.m.fence(blocks)
        for b, i in zip(blocks, ids, strict=True):
            self.gpu[b].copy_(content(key(i)))
            self.gpu_key[b] = key(i)
        self.m.offload([(b, key(i)) for b, i in zip(blocks, ids, strict=True)])

    @rule()
    def step_done(self) -> None:
        self.m.step_done()

    @rule()
    def flush(self) -> None:
        self.m.flush()

    @rule(
        order=st.permutations(range(GPU_BLOCKS)),
        ids=st.lists(key_ids, min_size=1, max_size=3, unique=True),
    )
    def start_load(self, order: list[int], ids: list[int]) -> None:
        keys = [key(i) for i in ids]
        n = self.m.lookup(keys).num_blocks
        blocks = self.free_gpu(order)[:n]
        if n == 0 or len(blocks) < n:
            return
        self.n += 1
        load_id = f"load-{self.n}"
        self.m.start_load(load_id, keys[:n], blocks)
        self.loads[load_id] = (keys[:n], blocks)
        for b in blocks:
            self.gpu_key.pop(b, None)

    @rule()
    def poll(self) -> None:
        for load_id, ok in self.m.poll_loads():
            keys, blocks = self.loads.pop(load_id)
            assert 0 <= ok <= len(keys)
            for k, b in zip(keys[:ok], blocks[:ok], strict=True):
                assert torch.equal(self.gpu[b], content(k))
                self.gpu_key[b] = k

    @rule(pick=st.integers(0, 7))
    def cancel(self, pick: int) -> None:
        if not self.loads:
            return
        load_id = sorted(self.loads)[pick % len(self.loads)]
        self.m.cancel(load_id)
        del self.loads[load_id]

    @invariant()
    def loads_keep_their_host_blocks(self) -> None:
        # A running load's host-resident keys stay pinned in the host until it is reported.
        for load_id, (keys, _) in self.loads.items():
            load = self.m._loads[load_id]
            for k in keys[: len(load.slots)]:
                assert self.m.host.holds(k) and self.m.host.is_pinned(k)

    @invariant()
    def host_entries_hold_their_keys(self) -> None:
        h = self.m.host
        s = h.stats()
        assert s.occupancy_blocks <= HOST_BLOCKS
        for i in range(12):
            k = key(i)
            if k in h:
                assert torch.equal(h.row(h._entries[k]), content(k))


TestHostAndDisk = HostAndDisk.TestCase
TestHostAndDisk.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestManager = Manager.TestCase
TestManager.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
