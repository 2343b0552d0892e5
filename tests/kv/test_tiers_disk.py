"""The disk tier: round trips, eviction within capacity, restarts, other layouts, corrupt
entries."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from ember.kv.tiers.base import BlockLayout
from ember.kv.tiers.disk import HEADER, KEY_FILE, MARKER, DiskDirError, DiskTier, tag
from ember.kv.tiers.host_memory import HostMemory

LAYOUT = BlockLayout(
    num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32", model="m"
)
ENTRY = HEADER.size + 32 + LAYOUT.nbytes  # bytes of one entry on disk


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, LAYOUT.nbytes), dtype=torch.uint8, generator=g)


def test_round_trip_is_byte_identical(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
    src = blocks(3)
    keys = [key(i) for i in range(3)]
    assert disk.put(keys, src) == [True] * 3
    assert disk.contains_prefix(keys) == 3
    dst = torch.zeros_like(src)
    assert disk.get_into(keys, dst) == [True] * 3
    assert torch.equal(dst, src)
    assert disk.path_of(keys[0]).parent.name == keys[0][:1].hex()  # fanned out by the first byte
    s = disk.stats()
    assert (s.blocks_in, s.blocks_out, s.hits, s.occupancy_blocks) == (3, 3, 3, 3)
    assert s.occupancy_bytes == 3 * ENTRY


def test_missing_key_is_a_miss_and_prefix_stops_there(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
    disk.put([key(0), key(2)], blocks(2))
    assert disk.contains_prefix([key(0), key(1), key(2)]) == 1
    dst = torch.zeros(2, LAYOUT.nbytes, dtype=torch.uint8)
    assert disk.get_into([key(0), key(1)], dst) == [True, False]
    assert disk.stats().misses == 1


def test_rows_forms_read_and_write_in_place(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
    src = blocks(4, seed=1)
    buf = HostMemory(LAYOUT.nbytes, 4, pin=False)
    for slot in range(4):
        buf.row(slot).copy_(src[slot])
    assert disk.put_rows([key(0), key(1)], buf, [3, 1]) == [True, True]
    out = HostMemory(LAYOUT.nbytes, 4, pin=False)
    assert disk.get_into_rows([key(1), key(0)], out, [0, 2]) == [True, True]
    assert torch.equal(out.row(0), src[1]) and torch.equal(out.row(2), src[3])


def test_lru_by_last_use_within_capacity(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 3 * ENTRY, LAYOUT, eviction="lru")
    disk.put([key(i) for i in range(3)], blocks(3))
    disk.touch([key(0)])  # a request used it: 1 is now LRU
    disk.put([key(3)], blocks(1, seed=3))
    assert disk.contains_prefix([key(1)]) == 0 and not disk.path_of(key(1)).exists()
    assert all(disk.contains_prefix([key(i)]) for i in (0, 2, 3))
    s = disk.stats()
    assert s.evictions == 1 and s.occupancy_bytes <= s.capacity_bytes
    assert sum(1 for _ in tmp_path.rglob("*.kv")) == 3


def test_index_is_rebuilt_after_restart_in_lru_order(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 3 * ENTRY, LAYOUT, eviction="lru")
    src = blocks(3)
    keys = [key(i) for i in range(3)]
    disk.put(keys, src)
    for i, k in enumerate(keys):  # make the order plain to the file system: 0 oldest
        os.utime(disk.path_of(k), (1000 + i, 1000 + i))
    disk.close()
    again = DiskTier(tmp_path, 3 * ENTRY, LAYOUT, eviction="lru")
    assert again.contains_prefix(keys) == 3
    assert again.stats().occupancy_blocks == 3
    dst = torch.zeros_like(src)
    assert again.get_into(keys, dst) == [True] * 3 and torch.equal(dst, src)
    again.touch(keys[1:])  # used since: 0 is the oldest
    again.put([key(9)], blocks(1, seed=9))  # evicts the oldest by last use
    assert again.contains_prefix([keys[0]]) == 0


def test_restart_with_less_capacity_evicts_the_oldest(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 3 * ENTRY, LAYOUT)
    keys = [key(i) for i in range(3)]
    disk.put(keys, blocks(3))
    for i, k in enumerate(keys):
        os.utime(disk.path_of(k), (1000 + i, 1000 + i))
    small = DiskTier(tmp_path, 2 * ENTRY, LAYOUT, eviction="lru")
    assert [small.contains_prefix([k]) for k in keys] == [0, 1, 1]
    assert not disk.path_of(keys[0]).exists()


def test_other_layout_entries_are_ignored_and_kept(tmp_path: Path) -> None:
    other = BlockLayout(2, 2, 4, 4, "float32", "another-model")
    DiskTier(tmp_path, 10 * ENTRY, other).put([key(5)], blocks(1))
    mine = DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
    assert mine.contains_prefix([key(5)]) == 0
    assert mine.stats().occupancy_blocks == 0 and mine.stats().occupancy_bytes == 0
    assert mine.path_of(key(5)).exists()  # not ours to delete
    assert DiskTier(tmp_path, 10 * ENTRY, other).contains_prefix([key(5)]) == 1


def test_leftover_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    DiskTier(tmp_path, 10 * ENTRY, LAYOUT)  # the directory becomes ember's
    sub = tmp_path / "ab"
    sub.mkdir()
    tmp = sub / ("ab" * 32 + ".kv.1234abcd.tmp")
    tmp.write_bytes(b"half a write")
    DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
    assert not tmp.exists()


def test_files_are_private_and_the_directory_marked(tmp_path: Path) -> None:
    """Before: block files were world-readable (0644)."""
    root = tmp_path / "kv"
    disk = DiskTier(root, 10 * ENTRY, LAYOUT)
    disk.put([key(0)], blocks(1))
    assert root.stat().st_mode & 0o777 == 0o700
    assert disk.path_of(key(0)).stat().st_mode & 0o777 == 0o600
    assert disk.path_of(key(0)).parent.stat().st_mode & 0o777 == 0o700
    assert (root / MARKER).exists() and (root / KEY_FILE).stat().st_mode & 0o777 == 0o600


def test_a_directory_of_other_files_is_refused_and_nothing_deleted(tmp_path: Path) -> None:
    """Before: --kv-disk-dir on an existing directory deleted user files that looked like its
    own (`ab/thesis.tmp`)."""
    (tmp_path / "ab").mkdir()
    thesis = tmp_path / "ab" / "thesis.tmp"
    thesis.write_text("four years of work")
    other = tmp_path / "ab" / ("cd" * 32 + ".kv")
    other.write_bytes(b"not a block")
    with pytest.raises(DiskDirError, match="not an ember KV directory"):
        DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
    assert thesis.read_text() == "four years of work" and other.read_bytes() == b"not a block"
    assert not (tmp_path / MARKER).exists()


def test_a_forged_entry_with_a_recomputed_checksum_is_refused(tmp_path: Path) -> None:
    """Before: the checksum was not keyed, so a file written by anyone who could write the
    directory, with its checksum recomputed, was served as KV."""
    disk = DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
    disk.put([key(0)], blocks(1))
    path = disk.path_of(key(0))
    magic, fp, klen, length, _ = HEADER.unpack_from(path.read_bytes())
    forged = bytes([0x21]) * length
    for digest in (
        hashlib.blake2b(forged, digest_size=16).digest(),  # the old, unkeyed checksum
        tag(b"\0" * 32, key(0), memoryview(forged)),  # keyed, with a guessed key
    ):
        path.write_bytes(HEADER.pack(magic, fp, klen, length, digest) + key(0) + forged)
        restarted = DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
        assert restarted.contains_prefix([key(0)]) == 1  # indexed from its header ...
        out = torch.zeros(1, LAYOUT.nbytes, dtype=torch.uint8)
        assert restarted.get_into([key(0)], out) == [False]  # ... but refused on read
        assert restarted.stats().corrupt == 1 and not path.exists()
    # A block moved to another key's name fails too (the tag covers the key).
    disk = DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
    disk.put([key(1)], blocks(1, seed=1))
    disk.path_of(key(2)).parent.mkdir(exist_ok=True)
    moved = bytearray(disk.path_of(key(1)).read_bytes())
    moved[HEADER.size : HEADER.size + 32] = key(2)
    disk.path_of(key(2)).write_bytes(bytes(moved))
    restarted = DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
    assert restarted.get_into([key(2)], torch.zeros(1, LAYOUT.nbytes, dtype=torch.uint8)) == [False]


def test_a_full_disk_is_counted_and_logged_once(tmp_path: Path, monkeypatch, caplog) -> None:
    """Before: a full disk logged a warning per block (1,030 lines in 1.6 s)."""
    import errno

    disk = DiskTier(tmp_path, 100 * ENTRY, LAYOUT)
    real_open = os.open

    def full(path, flags, mode=0o777, **kw):  # noqa: ANN001, ANN202
        if str(path).endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", full)
    with caplog.at_level("WARNING", logger="ember.kv.tiers.disk"):
        assert disk.put([key(i) for i in range(50)], blocks(50)) == [False] * 50
    assert disk.stats().errors == 50
    assert disk.stats().occupancy_bytes == 0
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1


def test_capacity_follows_the_filesystems_free_space(tmp_path: Path, monkeypatch) -> None:
    import ember.kv.tiers.disk as disk_module

    disk = DiskTier(tmp_path, 100 * ENTRY, LAYOUT)
    real = os.statvfs(tmp_path)

    class Tight:
        f_frsize = 1
        f_bavail = disk_module.FREE_RESERVE_BYTES + 3 * ENTRY  # room for three more entries

    monkeypatch.setattr(disk_module.os, "statvfs", lambda _: Tight)
    monkeypatch.setattr(disk_module, "FREE_CHECK_S", 1e9)  # the first reading stands
    disk._free_checked = -1e9  # noqa: SLF001 - read the (tight) free space now
    assert disk.put([key(i) for i in range(6)], blocks(6)) == [True] * 6
    # Never more than the free space allowed: the oldest were evicted to make room.
    assert disk.stats().occupancy_blocks == 3
    assert disk.stats().evictions == 3
    assert real.f_bavail > 0


@pytest.mark.parametrize("damage", ["truncate", "bit_flip", "header", "empty"])
def test_damaged_entry_is_a_miss_and_deleted(tmp_path: Path, damage: str) -> None:
    disk = DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
    src = blocks(2)
    disk.put([key(0), key(1)], src)
    path = disk.path_of(key(1))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-7]
    elif damage == "bit_flip":
        data[-100] ^= 0x10
    elif damage == "header":
        data[HEADER.size - 1] ^= 0xFF  # the checksum field
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    dst = torch.zeros_like(src)
    assert disk.get_into([key(0), key(1)], dst) == [True, False]
    assert torch.equal(dst[0], src[0])
    assert not path.exists() and disk.contains_prefix([key(0), key(1)]) == 1
    s = disk.stats()
    assert s.corrupt == 1 and s.misses == 1 and s.occupancy_blocks == 1


def test_truncated_entry_is_dropped_at_restart(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
    disk.put([key(0)], blocks(1))
    path = disk.path_of(key(0))
    path.write_bytes(path.read_bytes()[: ENTRY // 2])
    again = DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
    assert again.contains_prefix([key(0)]) == 0 and not path.exists()


def test_bad_shapes_are_refused(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 10 * ENTRY, LAYOUT)
    with pytest.raises(ValueError, match="shape"):
        disk.put([key(0)], torch.zeros(1, LAYOUT.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        disk.get_into([key(0)], torch.zeros(1, LAYOUT.nbytes))


def test_round_robin_sessions_keep_most_of_their_blocks_on_disk(tmp_path: Path) -> None:
    """Sessions taking turns over a disk tier that holds fewer than all of them: next-use keeps
    a fixed share of them (LRU would keep none)."""
    for policy, low, high in (("next-use", 0.45, 1.0), ("lru", 0.0, 0.05)):
        root = tmp_path / policy
        disk = DiskTier(root, 24 * ENTRY, LAYOUT, eviction=policy)
        now = [1000.0]
        disk.policy.clock = lambda now=now: now[0]
        sessions = [[key(100 * s + i) for i in range(8)] for s in range(4)]  # 32 blocks
        hit = asked = 0
        for r in range(5):
            for chain in sessions:
                now[0] += 2.0
                found = disk.contains_prefix(chain)
                if r:
                    hit, asked = hit + found, asked + len(chain)
                disk.put(chain[found:], blocks(len(chain) - found, seed=r))
                disk.touch(chain)
        assert low <= hit / asked <= high, (policy, hit / asked)
        assert sum(1 for _ in root.rglob("*.kv")) == disk.stats().occupancy_blocks <= 24
