"""The Mooncake Store tier against a real `mooncake_master` (started here, stopped after)."""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import multiprocessing as mp
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import pytest
import torch

from ember.kv.tiers.base import BlockLayout
from ember.kv.tiers.host_memory import HostMemory
from ember.kv.tiers.store_master import (
    StoreMaster,
    free_port,
    master_binary,
    split_address,
    start_master,
)

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # before the library loads: no INFO lines
if os.environ.get("CI") and sys.platform == "linux" and platform.machine() == "x86_64":
    import mooncake.store  # noqa: F401  CI installs the wheel: a missing one fails, never skips
else:
    pytest.importorskip("mooncake.store", reason="the Mooncake wheel (extra 'pd-cpu') is missing")
if master_binary() is None:
    pytest.skip("the Mooncake wheel ships no mooncake_master binary", allow_module_level=True)

from ember.kv.tiers import store_connection  # noqa: E402
from ember.kv.tiers.store import StoreTier, store_key  # noqa: E402
from ember.kv.transport.listen_host import listening_sockets  # noqa: E402

LAYOUT = BlockLayout(
    num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", model="m1"
)
SEGMENT = 16 << 20  # the smallest segment Mooncake takes
SECRET = "store-test-secret"


def keys_of(tag: int, n: int) -> list[bytes]:
    """n distinct 32-byte keys, like chained block hashes."""
    return [bytes([tag, i]) * 16 for i in range(n)]


def blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, LAYOUT.nbytes), dtype=torch.uint8, generator=g)


def eventually(check: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Poll until `check()` holds; a bound on waiting, not a measurement."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_split_address() -> None:
    assert split_address("10.0.0.2:50051") == ("10.0.0.2", 50051)
    assert split_address("[::1]:50051") == ("::1", 50051)
    for bad in ("10.0.0.2", ":50051", "host:port", "host:0", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            split_address(bad)


@pytest.fixture(scope="module")
def master() -> Iterator[StoreMaster]:
    m = start_master()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def tier(master: StoreMaster) -> Iterator[StoreTier]:
    t = StoreTier(LAYOUT, master.address, segment_bytes=SEGMENT, secret=SECRET)
    yield t
    t.close()


@pytest.fixture(scope="module")
def other(master: StoreMaster) -> Iterator[StoreTier]:
    """A second client of the same store, as a second engine would be."""
    t = StoreTier(LAYOUT, master.address, segment_bytes=SEGMENT, secret=SECRET)
    yield t
    t.close()


def test_bytes_round_trip(tier: StoreTier) -> None:
    keys, src = keys_of(1, 5), blocks(5, seed=1)
    assert tier.put(keys, src) == [True] * 5
    assert tier.contains_prefix(keys) == 5
    dst = torch.zeros_like(src)
    assert tier.get_into(keys, dst) == [True] * 5
    assert torch.equal(dst, src)
    s = tier.stats()
    assert s.blocks_in >= 5 and s.hits >= 5 and s.bytes_out >= 5 * LAYOUT.nbytes


def test_rows_of_the_host_memory_round_trip(tier: StoreTier) -> None:
    """put_rows / get_into_rows move rows of the host tier's memory, in any order and across its
    chunks (each registered with the store as a write first reads from it)."""
    host = HostMemory(LAYOUT.nbytes, 8, pin=False, chunk_bytes=2 * LAYOUT.nbytes)
    assert len(host.chunks) == 4
    src = blocks(3, seed=2)
    for i, slot in enumerate([6, 2, 4]):
        host.row(slot).copy_(src[i])
    keys = keys_of(2, 3)
    assert tier.put_rows(keys, host, [6, 2, 4]) == [True] * 3
    back = HostMemory(LAYOUT.nbytes, 8, pin=False)
    for slot in range(8):
        back.row(slot).zero_()
    assert tier.get_into_rows(keys, back, [1, 7, 0]) == [True] * 3
    assert all(torch.equal(back.row(d), src[i]) for i, d in enumerate([1, 7, 0]))
    # rows not asked for are untouched
    assert all(torch.count_nonzero(back.row(s)) == 0 for s in [2, 3, 4, 5, 6])
    with pytest.raises(IndexError):
        tier.put_rows(keys[:1], host, [8])  # no address outside the memory reaches the store


def test_put_in_chunks_larger_than_the_staging_buffer(master: StoreMaster) -> None:
    t = StoreTier(
        LAYOUT,
        master.address,
        segment_bytes=SEGMENT,
        secret=SECRET,
        staging_bytes=3 * LAYOUT.nbytes,
    )
    try:
        keys, src = keys_of(3, 8), blocks(8, seed=3)
        assert t.put(keys, src) == [True] * 8
        dst = torch.zeros_like(src)
        assert t.get_into(keys, dst) == [True] * 8
        assert torch.equal(dst, src)
    finally:
        t.close()


def test_two_clients_see_each_others_blocks(tier: StoreTier, other: StoreTier) -> None:
    keys, src = keys_of(4, 4), blocks(4, seed=4)
    assert tier.put(keys, src) == [True] * 4
    assert other.contains_prefix(keys) == 4
    # A prefix stops at the first block the store lacks.
    assert other.contains_prefix([keys[0], keys[1], b"\xee" * 32, keys[3]]) == 2
    dst = torch.zeros_like(src)
    assert other.get_into(keys, dst) == [True] * 4
    assert torch.equal(dst, src)


def _writer(address: str, conn: Connection) -> None:
    """Another engine's process: writes blocks to the store and stays up (its segment may hold
    them) until told to leave."""
    t = StoreTier(LAYOUT, address, segment_bytes=SEGMENT, secret=SECRET)
    conn.send(t.put(keys_of(5, 6), blocks(6, seed=5)))
    conn.recv()
    t.close()


def test_a_block_written_by_another_process_is_read_here(
    master: StoreMaster, tier: StoreTier
) -> None:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_writer, args=(master.address, child))
    proc.start()
    try:
        assert conn.poll(60), "the writer process did not report"
        assert conn.recv() == [True] * 6
        keys = keys_of(5, 6)
        assert tier.contains_prefix(keys) == 6
        dst = torch.zeros((6, LAYOUT.nbytes), dtype=torch.uint8)
        assert tier.get_into(keys, dst) == [True] * 6
        assert torch.equal(dst, blocks(6, seed=5))
    finally:
        conn.send("exit")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_another_layout_misses(master: StoreMaster, tier: StoreTier) -> None:
    keys = keys_of(6, 3)
    assert tier.put(keys, blocks(3, seed=6)) == [True] * 3
    ours = store_key(LAYOUT.fingerprint(), keys[0])
    for changed in (
        BlockLayout(2, 2, 8, 4, "float16", "m1"),  # another dtype
        BlockLayout(2, 2, 8, 2, "float32", "m1"),  # another block size
        BlockLayout(2, 1, 8, 4, "float32", "m1"),  # other heads
    ):
        assert store_key(changed.fingerprint(), keys[0]) != ours
    # Another model with blocks of the very same size: only the key keeps them apart.
    model2 = BlockLayout(2, 2, 8, 4, "float32", "m2")
    t = StoreTier(model2, master.address, segment_bytes=SEGMENT, secret=SECRET)
    try:
        assert t.contains_prefix(keys) == 0
        dst = torch.zeros((3, model2.nbytes), dtype=torch.uint8)
        assert t.get_into(keys, dst) == [False] * 3
        assert torch.count_nonzero(dst) == 0
    finally:
        t.close()


def test_put_of_an_existing_key_is_fine(tier: StoreTier) -> None:
    keys, src = keys_of(7, 2), blocks(2, seed=7)
    assert tier.put(keys, src) == [True, True]
    assert tier.put(keys, src) == [True, True]
    dst = torch.zeros_like(src)
    assert tier.get_into(keys, dst) == [True, True]
    assert torch.equal(dst, src)
    assert tier.connected


def test_written_blocks_are_stored_events_of_the_store_medium(tier: StoreTier) -> None:
    keys, src = keys_of(40, 3), blocks(3, seed=40)
    tier.events.drain()
    tier.put(keys, src)
    assert tier.events.drain() == []  # recorded only when the engine asks for KV events
    tier.events.enabled = True
    try:
        assert tier.put(keys, src) == [True] * 3
        assert tier.events.drain() == [("stored", k, "store") for k in keys]
    finally:
        tier.events.enabled = False


def test_a_missing_block_is_a_miss(tier: StoreTier) -> None:
    keys = keys_of(8, 2)
    tier.put(keys[:1], blocks(1, seed=8))
    dst = torch.zeros((2, LAYOUT.nbytes), dtype=torch.uint8)
    misses = tier.stats().misses
    assert tier.get_into(keys, dst) == [True, False]
    assert torch.count_nonzero(dst[1]) == 0
    assert tier.stats().misses == misses + 1
    assert tier.connected  # a miss is no fault


def test_the_client_listens_on_its_host_only(master: StoreMaster) -> None:
    before = listening_sockets()
    t = StoreTier(LAYOUT, master.address, host="127.0.0.1", segment_bytes=SEGMENT, secret=SECRET)
    try:
        opened = listening_sockets() - before
        assert opened, "the store client opened no listener"
        for addr, _ in opened:
            ip = ipaddress.ip_address(addr)
            assert str(getattr(ip, "ipv4_mapped", None) or ip) == "127.0.0.1", opened
    finally:
        t.close()


def test_master_killed_means_misses_then_it_recovers(caplog: pytest.LogCaptureFixture) -> None:
    m = start_master()
    t = StoreTier(LAYOUT, m.address, segment_bytes=SEGMENT, secret=SECRET)
    try:
        keys, src = keys_of(9, 3), blocks(3, seed=9)
        assert t.put(keys, src) == [True] * 3
        m.kill()
        with caplog.at_level(logging.WARNING, logger=store_connection.__name__):
            dst = torch.zeros_like(src)
            for _ in range(3):  # every call a miss, none raises
                assert t.contains_prefix(keys) == 0
                assert t.put(keys, src) == [False] * 3
                assert t.get_into(keys, dst) == [False] * 3
        outage = [r for r in caplog.records if "recomputed until" in r.getMessage()]
        assert len(outage) == 1, "one warning per outage"
        s = t.stats()
        assert s.errors >= 1 and s.drops >= 9
        assert not t.connected

        m.start()  # the same port: the client reconnects and re-mounts its segment
        assert t.wait_connected(20)
        # The new master's index starts empty: the old blocks are gone, new writes work.
        assert eventually(lambda: t.put(keys, src) == [True] * 3)
        assert t.contains_prefix(keys) == 3
        assert t.get_into(keys, dst) == [True] * 3
        assert torch.equal(dst, src)
    finally:
        t.close()
        m.stop()


def test_no_master_at_start_then_one_comes() -> None:
    port = free_port("127.0.0.1")
    t = StoreTier(
        LAYOUT, f"127.0.0.1:{port}", segment_bytes=SEGMENT, secret=SECRET, connect_timeout_s=0.1
    )
    m = StoreMaster("127.0.0.1", port, free_port("127.0.0.1"))
    try:
        keys, src = keys_of(10, 2), blocks(2, seed=10)
        assert not t.connected
        assert t.contains_prefix(keys) == 0
        assert t.put(keys, src) == [False, False]
        m.start()
        assert t.wait_connected(30)
        assert eventually(lambda: t.put(keys, src) == [True, True])
        assert t.contains_prefix(keys) == 2
    finally:
        t.close()
        m.stop()


class _FailingReads:
    """Stands in for the Mooncake client: every read fails mid-transfer (a peer that died)."""

    def __init__(self) -> None:
        self.registered: list[int] = []

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered.append(ptr)
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return 0

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return [-800] * len(keys)  # TRANSFER_FAIL: bytes may still be arriving

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return [-200] * len(keys)  # NO_AVAILABLE_HANDLE: the store is full

    def close(self) -> int:
        return 0


def _with_client(client: object, **kw: float) -> StoreTier:
    """A tier that found no master, handed a stand-in client as if it had connected."""
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    t = StoreTier(LAYOUT, address, segment_bytes=SEGMENT, secret=SECRET, connect_timeout_s=0, **kw)
    t._conn._client = client
    t._conn._up.set()
    return t


def test_a_failed_transfer_never_lands_in_the_host_buffer() -> None:
    fake = _FailingReads()
    t = _with_client(fake)
    errors = t.stats().errors
    try:
        host = HostMemory(LAYOUT.nbytes, 4, pin=False)
        for slot in range(4):
            host.row(slot).fill_(7)
        assert t.get_into_rows(keys_of(11, 2), host, [0, 1]) == [False, False]
        # The library was handed a staging buffer of the tier's own, never the host rows...
        assert host.chunks[0].data_ptr() not in fake.registered
        assert all(bool((host.row(s) == 7).all()) for s in range(4))
        # ...which is set aside (still registered) rather than reused for the next read.
        assert len(t._retired) == 2 and t._staging is None and t._tags is None
        assert not t.connected and t.stats().errors == errors + 1
    finally:
        t.close()


def test_a_full_store_drops_writes_without_an_outage() -> None:
    t = _with_client(_FailingReads())
    errors = t.stats().errors
    try:
        assert t.put(keys_of(12, 3), blocks(3, seed=12)) == [False] * 3
        s = t.stats()
        assert s.drops == 3 and s.errors == errors and t.connected
    finally:
        t.close()


class _HungMaster(_FailingReads):
    """A client whose lookups hang, as they do for seconds on a master that stopped answering."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.calls = 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls += 1
        self.release.wait(30)
        return [1] * len(keys)


def test_a_hung_lookup_is_a_miss_and_later_lookups_do_not_queue_behind_it() -> None:
    fake = _HungMaster()
    t = _with_client(fake, lookup_timeout_s=0.05)
    try:
        keys = keys_of(13, 2)
        assert t.contains_prefix(keys) == 0  # gave up waiting: a miss
        assert not t.connected
        t._conn._up.set()  # as if the connector's probe had succeeded meanwhile
        assert t.contains_prefix(keys) == 0  # the overrunning call is still out: not called again
        assert fake.calls == 1
        fake.release.set()
        assert eventually(lambda: t._stuck_lookup is not None and t._stuck_lookup.done())
        t._conn._up.set()
        assert t.contains_prefix(keys) == 2
    finally:
        fake.release.set()
        t.close()


def plant(client_tier: StoreTier, names: list[str], values: list[bytes]) -> None:
    """Overwrite objects as any client of the store can (upsert from registered memory)."""
    buf = torch.frombuffer(bytearray(b"".join(values)), dtype=torch.uint8)
    assert client_tier._register(buf)
    addrs, at = [], buf.data_ptr()
    for v in values:
        addrs.append(at)
        at += len(v)
    codes = client_tier._conn.client.batch_upsert_from(names, addrs, [len(v) for v in values])
    assert list(codes) == [0] * len(values), codes


def test_a_block_planted_without_the_secret_is_a_miss(master: StoreMaster, tier: StoreTier) -> None:
    """Before: any store client could overwrite a block, and it was served (a victim's prompt
    came back as '!!!!'). Now each block's tag is keyed by the cluster secret."""
    keys, src = keys_of(20, 3), blocks(3, seed=20)
    assert tier.put(keys, src) == [True] * 3
    attacker = StoreTier(LAYOUT, master.address, segment_bytes=SEGMENT, secret="not-the-secret")
    try:
        assert attacker.contains_prefix(keys) == 0  # its names are not ours: it finds nothing
        names = tier._names(keys)  # as a listing of the store shows them
        junk = b"!" * LAYOUT.nbytes
        # A block overwritten, and one with a tag recomputed as an unkeyed checksum would be.
        digest = hashlib.blake2b(names[1].encode() + b"\0" + junk, digest_size=16).digest()
        plant(attacker, [names[0], names[1], names[1] + ".tag"], [junk, junk, digest])
        corrupt = tier.stats().corrupt
        dst = torch.zeros_like(src)
        assert tier.get_into(keys, dst) == [False, False, True]
        assert torch.count_nonzero(dst[:2]) == 0 and torch.equal(dst[2], src[2])
        assert tier.stats().corrupt == corrupt + 2
        assert tier.connected  # a forged block is a miss, not an outage
    finally:
        attacker.close()


def test_names_in_the_store_hide_the_block_hashes(tier: StoreTier) -> None:
    keys = keys_of(21, 2)
    names = tier._names(keys)
    assert all(k.hex() not in n for k, n in zip(keys, names, strict=True))
    assert store_key(LAYOUT.fingerprint(), keys[0]) != names[0]  # the plain name is not used


def test_the_master_listens_on_its_host_only(master: StoreMaster) -> None:
    """Its RPC port and its metrics/admin port (which `mooncake_master` cannot turn off, and
    which lists every key: why names are keyed) both on the master's host, never a wildcard."""
    from ember.kv.transport.listen_host import listening_sockets

    assert master.popen is not None
    found = listening_sockets(master.popen.pid)
    assert {port for _, port in found} >= {master.port, master.metrics_port}
    assert {host for host, _ in found} == {"127.0.0.1"}
