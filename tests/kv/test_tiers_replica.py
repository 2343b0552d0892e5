"""A tensor-parallel engine's host tier on the CPU, without processes: rank 0's TierManager sends
its copies and fences to a HostReplica over another rank's cache (its own heads: other bytes),
which repeats them in the same host slots; each rank's blocks come back as its own."""

from __future__ import annotations

import hashlib

import pytest
import torch

from ember.kv.tiers.base import BlockLayout
from ember.kv.tiers.cost import CostModel
from ember.kv.tiers.host import HostTier
from ember.kv.tiers.host_memory import HostMemory
from ember.kv.tiers.manager import TierManager
from ember.kv.tiers.replica import HostReplica

LAYOUT = BlockLayout(
    num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32", model="m"
)
NBYTES = LAYOUT.nbytes


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, NBYTES), dtype=torch.uint8, generator=g)


class Forward:
    """Rank 0's side of the wire: every call recorded, then made on the other rank's replica."""

    def __init__(self, replica: HostReplica) -> None:
        self.replica = replica
        self.calls: list[tuple] = []

    def copy(self, up: bool, slots: list[int], gpu_ids: list[int]) -> None:
        self.calls.append(("copy", up, list(slots), list(gpu_ids)))
        self.replica.copy(up, slots, gpu_ids)

    def fence(self, block_ids: list[int]) -> None:
        self.calls.append(("fence", sorted(block_ids)))
        self.replica.fence(block_ids)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_other_rank_gets_its_own_blocks_back(device: str) -> None:
    """On CUDA both ranks' copies run on side streams (pinned memory) in the same process."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rank0, rank1 = blocks(16, 0).to(device), blocks(16, 1).to(device)
    want0, want1 = rank0[2:6].clone(), rank1[2:6].clone()
    pin = device == "cuda"
    replica = HostReplica(HostMemory(NBYTES, 8, pin=pin), rank1)
    wire = Forward(replica)
    tiers = TierManager(
        LAYOUT, rank0, HostTier(LAYOUT, 8, pin=pin), [], CostModel(LAYOUT), replicas=wire
    )
    keys = [key(i) for i in range(4)]
    tiers.offload(zip(range(2, 6), keys, strict=True))
    tiers.flush()  # rank 0's copies ended and committed (the replica's may still run)
    assert wire.calls[0][:2] == ("copy", False) and wire.calls[0][3] == [2, 3, 4, 5]
    # Both ranks' blocks 2-5 are handed out again and overwritten; the fence says which.
    tiers.fence([2, 3])
    assert wire.calls[-1] == ("fence", [2, 3])
    tiers.fence(range(16))
    rank0[:] = 0
    rank1[:] = 0
    tiers.start_load("l", keys, [9, 10, 11, 12])
    done: list = []
    while not done:  # on CUDA the copy up ends later
        done = tiers.poll_loads()
    assert done == [("l", 4)]
    up = [c for c in wire.calls if c[:2] == ("copy", True)]
    assert len(up) == 1 and up[0][3] == [9, 10, 11, 12]
    assert wire.calls[-1] == ("fence", [9, 10, 11, 12])  # before the steps that read them
    if device == "cuda":
        torch.cuda.synchronize()  # the fences ordered the current stream after the copies
    assert torch.equal(rank0[9:13], want0) and torch.equal(rank1[9:13], want1)
    assert replica.copies == 2
    tiers.close()
    replica.close()


def test_a_slot_past_the_replica_s_growth_is_allocated_on_the_spot() -> None:
    memory = HostMemory(NBYTES, 8, pin=False, chunk_bytes=2 * NBYTES, background=True, pace="hold")
    assert memory.num_rows == 2  # held: the first chunk only
    cache = blocks(4, 2)
    replica = HostReplica(memory, cache)
    replica.copy(False, [5], [1])
    assert memory.num_rows == 6
    assert torch.equal(memory.row(5), cache[1])
    memory.grow_to(100)  # never past its target
    assert memory.num_rows == 8
    replica.close()


@pytest.mark.parametrize(
    "slots,ids,match",
    [([0, 1], [0], "2 slots but 1 blocks"), ([0], [4], "outside"), ([-1], [0], "negative")],
)
def test_bad_copies_are_refused(slots: list[int], ids: list[int], match: str) -> None:
    replica = HostReplica(HostMemory(NBYTES, 4, pin=False), blocks(4, 3))
    with pytest.raises(ValueError, match=match):
        replica.copy(False, slots, ids)
    replica.close()


def test_rows_of_another_size_are_refused() -> None:
    with pytest.raises(ValueError, match="bytes"):
        HostReplica(HostMemory(NBYTES, 4, pin=False), blocks(4, 3)[:, :8])


class FakeChannel:
    """The other ranks' answers to a sharded tier's jobs, set by the test."""

    def __init__(self, counts: list[int] | None) -> None:
        self.counts = counts
        self.sent: list[tuple] = []
        self.touched: list[tuple[str, bytes]] = []
        self.ids = 0

    def new_job_id(self) -> int:
        self.ids += 1
        return self.ids

    def send(
        self, job_id: int, medium: str, write: bool, keys: list[bytes], slots: list[int]
    ) -> None:
        self.sent.append((job_id, medium, write, len(keys), list(slots)))

    def wait(self, job_id: int, timeout_s: float) -> list[int] | None:
        return self.counts

    def touch(self, medium: str, keys: list[bytes]) -> None:
        self.touched += [(medium, k) for k in keys]


def test_a_sharded_tier_counts_what_every_rank_got(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ember.kv.tiers.disk import DiskTier
    from ember.kv.tiers.replica import ShardedTier

    memory = HostMemory(NBYTES, 8, pin=False)
    memory.copy_in(range(4), blocks(4, 4), range(4), False)
    keys = [key(i) for i in range(4)]
    channel = FakeChannel([4])
    tier = ShardedTier(DiskTier(tmp_path, 1 << 20, LAYOUT), channel)
    assert tier.put_rows(keys, memory, [0, 1, 2, 3]) == [True] * 4
    assert channel.sent[-1] == (1, "disk", True, 4, [0, 1, 2, 3])
    channel.counts = [2]  # the other rank found the first two only
    assert tier.get_into_rows(keys, memory, [4, 5, 6, 7]) == [True, True, False, False]
    assert tier.stats().hits == 2 and tier.stats().misses >= 2
    channel.counts = None  # a rank that does not answer: nothing counts
    assert tier.get_into_rows(keys, memory, [4, 5, 6, 7]) == [False] * 4
    tier.touch(keys[:1])
    assert channel.touched == [("disk", keys[0])]
    tier.close()


def test_a_replica_s_disk_jobs_write_and_read_its_own_rows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ember.kv.tiers.disk import DiskTier
    from ember.kv.tiers.replica import LowerReplica

    answers: list[tuple[int, int]] = []

    class Ack:
        closed = False

        def __call__(self, job_id: int, count: int) -> None:
            answers.append((job_id, count))

        def close(self) -> None:
            Ack.closed = True

    cache = blocks(4, 5)
    replica = HostReplica(HostMemory(NBYTES, 8, pin=False), cache)
    replica.copy(False, [0, 1], [2, 3])
    lower = LowerReplica(replica, [DiskTier(tmp_path, 1 << 20, LAYOUT)], Ack())
    keys = [key(i) for i in range(3)]
    lower.submit(1, "disk", True, keys[:2], [0, 1])
    lower.submit(2, "disk", False, keys, [5, 6, 7])  # the third was never written
    lower.submit(3, "disk", True, keys[:1], [-1])  # a bad slot: nothing stored, still answered
    lower.submit(4, "store", True, keys[:1], [0])  # no store on this rank: nothing stored
    lower.close()
    assert answers == [(1, 2), (2, 2), (3, 0), (4, 0)] and Ack.closed
    assert torch.equal(replica.memory.row(5), cache[2]) and torch.equal(
        replica.memory.row(6), cache[3]
    )
    replica.close()
