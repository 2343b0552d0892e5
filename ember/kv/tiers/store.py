"""The store tier: KV blocks in a Mooncake Store that every engine shares (`--kv-store HOST:PORT`).

A `mooncake_master` keeps the index; the bytes live in the memory segments the engines' clients
mount (`segment_bytes` each), so an engine's blocks leave with it (the master forgets them about
10 s after its last heartbeat) and the master evicts when the segments fill. A key is
`ember/<layout fingerprint prefix>/<block hash hex>`: engines of another model, dtype or block
layout never read each other's blocks, and tenants' blocks differ by their salted hashes.

Anyone who reaches the master's or a client's port can list, overwrite and delete objects (the
Mooncake Store has no access control: its network must be private). So nothing read is trusted:
every block is written with a tag, BLAKE2b keyed by the cluster secret over its name and bytes (a
small object beside it), and a read whose tag does not match is a miss, counted as corrupt. Names
are keyed too (`ember/<layout>/<keyed hash of the block hash>`): a listing of the store says
nothing about which prompts it holds. Engines that share a store share the cluster secret.

Faults never reach the engine: while the master is unreachable or transfers fail, every call is a
miss (False, 0) until the connection (store_connection.py) has the master answering again. Reads
land in a staging buffer of this tier and are copied on only once complete: after a failed
transfer Mooncake may still be writing into the buffer it was given, so that staging buffer is set
aside for a while, never a host-tier slot that is about to hold another block.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import torch

from ember.kv.tiers.base import (
    BlockLayout,
    EventLog,
    Medium,
    Tier,
    TierStats,
    check_rows,
    leading,
)
from ember.kv.tiers.store_connection import StoreConnection, StoreError

if TYPE_CHECKING:
    from ember.kv.tiers.host_memory import HostMemory

log = logging.getLogger(__name__)

FINGERPRINT_CHARS = 16
MIN_SEGMENT_BYTES = 16 << 20
"""Mooncake refuses a smaller segment."""
QUARANTINE_S = 90.0
"""How long a staging buffer of a failed read is kept aside: Mooncake's transfer timeout
(MC_TRANSFER_TIMEOUT, 30 s) with a margin."""

# Mooncake's ErrorCode values (its Python binding returns plain ints).
INVALID_PARAMS = -600  # e.g. the buffer is smaller than the object: refused before any transfer
NO_AVAILABLE_HANDLE = -200  # the segments are full: the write is dropped (the master evicts)
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707
RPC_FAIL = -900  # the master is unreachable
RPC_TIMEOUT = -901
_UNREACHABLE = frozenset({RPC_FAIL, RPC_TIMEOUT})
_SETTLED_MISS = frozenset({INVALID_PARAMS, REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND, LEASE_EXPIRED})
"""Read failures that end before or after the transfer, never during it."""


TAG_BYTES = 16
TAG_SUFFIX = ".tag"
_PROCESS_SECRET = secrets.token_hex(32)
"""The secret of tiers given none: only this process reads back what it wrote."""


def store_key(layout_fingerprint: str, key: bytes, name_key: bytes = b"") -> str:
    """The object name of block `key`; with `name_key`, the block hash is replaced by a keyed
    hash of it (what a listing of the store shows)."""
    if name_key:
        key = hashlib.blake2b(key, key=name_key, digest_size=16).digest()
    return f"ember/{layout_fingerprint[:FINGERPRINT_CHARS]}/{key.hex()}"


def block_tag(tag_key: bytes, name: str, payload: memoryview) -> bytes:
    """BLAKE2b-128 keyed by `tag_key` over the object's name and bytes."""
    h = hashlib.blake2b(name.encode() + b"\0", key=tag_key, digest_size=TAG_BYTES)
    h.update(payload)
    return h.digest()


def _row_view(row: torch.Tensor) -> memoryview:
    return memoryview(row.numpy()).cast("B")


class StoreTier(Tier):
    medium: Medium = "store"
    lookup_may_wait = True

    def __init__(
        self,
        layout: BlockLayout,
        master: str,
        host: str = "127.0.0.1",
        segment_bytes: int = 1 << 30,
        staging_bytes: int = 64 << 20,
        connect_timeout_s: float = 2.0,
        lookup_timeout_s: float = 1.0,
        protocol: str = "tcp",
        device: str = "",
        secret: str | None = None,
    ) -> None:
        """`master`: HOST:PORT of the `mooncake_master`; `host`: this engine's address, the only
        one the client listens on (`--kv-host`); `segment_bytes`: the memory this engine lends
        the store (allocated as it fills); `connect_timeout_s`: how long start-up waits for the
        first connection (then the tier starts as misses and keeps trying); `secret`: the
        cluster secret that keys names and tags (None: this process's own)."""
        if segment_bytes < MIN_SEGMENT_BYTES:
            raise StoreError(f"segment_bytes must be >= {MIN_SEGMENT_BYTES}, got {segment_bytes}")
        self.layout = layout
        self.master = master
        self._fingerprint = layout.fingerprint()
        root = hmac.new(
            (secret or _PROCESS_SECRET).encode(), b"ember KV store", hashlib.sha256
        ).digest()
        self._name_key = hmac.new(root, b"names", hashlib.sha256).digest()
        self._tag_key = hmac.new(root, b"tags", hashlib.sha256).digest()
        self._tags: torch.Tensor | None = None
        """Registered rows of TAG_BYTES: the tags of one chunk's writes or reads."""
        self._nbytes = layout.nbytes
        self._chunk = max(1, staging_bytes // self._nbytes)
        self._lookup_timeout_s = lookup_timeout_s
        self._registered: dict[int, torch.Tensor] = {}  # data_ptr -> the tensor kept alive
        self._staging: torch.Tensor | None = None
        self._retired: list[tuple[float, torch.Tensor]] = []  # (until, staging of a failed read)
        self._io_lock = threading.Lock()  # staging, registrations
        self._stats_lock = threading.Lock()
        self._stats = TierStats(capacity_bytes=segment_bytes)
        # "stored" events for the blocks this engine wrote (the router credits every engine on
        # this store for them); removals from the shared store are not observable here.
        self.events = EventLog("store")
        self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-store-lookup")
        self._stuck_lookup: Future[list[int]] | None = None
        self._conn = StoreConnection(
            master,
            host,
            segment_bytes,
            probe_key=store_key(self._fingerprint, b"probe", self._name_key),
            protocol=protocol,
            device=device,
            connect_timeout_s=connect_timeout_s,
        )

    # -- the Tier interface ------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._conn.connected

    def wait_connected(self, timeout_s: float) -> bool:
        """Whether the tier is (or becomes, within `timeout_s`) connected to its master."""
        return self._conn.wait_connected(timeout_s)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        return leading(self.present(keys))

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        client = self._conn.client
        stuck = self._stuck_lookup
        missing = [False] * len(keys)
        if client is None or not keys or (stuck is not None and not stuck.done()):
            return missing
        names = self._names(keys)
        # A lookup waits a bounded time, never the library's own timeouts (4 s and more) of a
        # master that stopped answering; while a call that overran is still out, lookups are
        # misses rather than queued behind it.
        future = self._lookups.submit(client.batch_is_exist, names)
        try:
            found = future.result(self._lookup_timeout_s)
        except FutureTimeout:
            self._stuck_lookup = future
            self._fail(f"a lookup took over {self._lookup_timeout_s:.1f} s")
            return missing
        except Exception as e:  # the binding raised: treated as an unreachable store
            self._fail(f"a lookup failed: {e}")
            return missing
        if len(found) != len(keys):
            self._fail(f"{len(found)} lookup results for {len(keys)} keys")
            return missing
        if any(rc in _UNREACHABLE for rc in found):
            self._fail("the master is unreachable")
            return missing
        return [rc == 1 for rc in found]

    def put(self, keys: Sequence[bytes], src: torch.Tensor) -> list[bool]:
        check_rows(src, len(keys), self._nbytes, "src")
        done: list[bool] = []
        for start in range(0, len(keys), self._chunk):
            stop = min(start + self._chunk, len(keys))
            with self._io_lock:
                staging = self._staging_rows(stop - start)
                if staging is None:
                    done += self._dropped(stop - start)
                    continue
                staging.copy_(src[start:stop])
                rows = [staging[i] for i in range(stop - start)]
                done += self._put_from(
                    keys[start:stop], self._addresses(staging, range(stop - start)), rows
                )
        return done

    def put_rows(
        self, keys: Sequence[bytes], memory: HostMemory, slots: Sequence[int]
    ) -> list[bool]:
        """Writes straight from the host tier's rows (each chunk registered with the store the
        first time a write reads from it)."""
        if not keys:
            return []
        if len(slots) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(slots)} slots")
        # locate() raises for a slot outside the memory: no stray address reaches the library.
        rows = [memory.locate(s) for s in slots]
        with self._io_lock:
            if not all(self._register(chunk) for chunk in {id(c): c for c, _ in rows}.values()):
                return self._dropped(len(keys))
            return self._put_from(
                keys,
                [c.data_ptr() + r * self._nbytes for c, r in rows],
                [memory.row(s) for s in slots],
            )

    def get_into(self, keys: Sequence[bytes], dst: torch.Tensor) -> list[bool]:
        check_rows(dst, len(keys), self._nbytes, "dst")
        return self._get(keys, lambda i, row: dst[i].copy_(row))

    def get_into_rows(
        self, keys: Sequence[bytes], memory: HostMemory, slots: Sequence[int]
    ) -> list[bool]:
        if len(slots) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(slots)} slots")
        rows = [memory.row(s) for s in slots]
        return self._get(keys, lambda i, row: rows[i].copy_(row))

    def stats(self) -> TierStats:
        with self._stats_lock:
            return self._stats.copy()

    def close(self) -> None:
        """Leave the store: this engine's segment (and the blocks in it) goes with it."""
        self._lookups.shutdown(wait=False)
        self._conn.close()
        with self._io_lock:  # only now: a failed read's late bytes may land until the close
            self._registered.clear()
            self._staging = None
            self._tags = None
            self._retired.clear()

    # -- reads and writes --------------------------------------------------------------------

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        return [store_key(self._fingerprint, k, self._name_key) for k in keys]

    def _put_from(
        self, keys: Sequence[bytes], addrs: list[int], rows: Sequence[torch.Tensor]
    ) -> list[bool]:
        """One batch write from registered memory (under the I/O lock): the blocks, then their
        tags (a block without its tag is a miss: written second, it counts only once both are)."""
        names = self._names(keys)
        tags = self._tag_rows(len(keys))
        if tags is None:
            return self._dropped(len(keys))
        for i, (name, row) in enumerate(zip(names, rows, strict=True)):
            digest = block_tag(self._tag_key, name, _row_view(row))
            tags[i].copy_(torch.frombuffer(bytearray(digest), dtype=torch.uint8))
        sizes = [self._nbytes] * len(keys)
        codes = self._native(lambda c: c.batch_put_from(names, addrs, sizes), len(keys))
        if codes is None:
            return self._dropped(len(keys))
        tag_names = [n + TAG_SUFFIX for n in names]
        tag_addrs = self._addresses(tags, range(len(keys)), TAG_BYTES)
        tag_codes = self._native(
            lambda c: c.batch_put_from(tag_names, tag_addrs, [TAG_BYTES] * len(keys)), len(keys)
        )
        if tag_codes is None:
            return self._dropped(len(keys))
        # An existing key holds the same bytes: its hash names its content.
        codes = [
            rc if rc not in (0, OBJECT_ALREADY_EXISTS) else t
            for rc, t in zip(codes, tag_codes, strict=True)
        ]
        done = [rc in (0, OBJECT_ALREADY_EXISTS) for rc in codes]
        failed = sorted({rc for rc in codes if rc not in (0, OBJECT_ALREADY_EXISTS)})
        with self._stats_lock:
            self._stats.blocks_in += sum(done)
            self._stats.bytes_in += sum(done) * self._nbytes
            self._stats.drops += len(done) - sum(done)
        self.events.record("stored", [k for k, ok in zip(keys, done, strict=True) if ok])
        if any(rc in _UNREACHABLE for rc in failed):
            self._fail("the master is unreachable")
        elif any(rc != NO_AVAILABLE_HANDLE for rc in failed):  # full is no fault: it evicts
            self._fail(f"a write failed (Mooncake error {failed[0]})")
        elif any(done):
            self._succeeded()
        return done

    def _get(self, keys: Sequence[bytes], place: Callable[[int, torch.Tensor], Any]) -> list[bool]:
        """Read `keys` through the staging buffer; `place(i, row)` copies key i's bytes on."""
        found: list[bool] = []
        for start in range(0, len(keys), self._chunk):
            stop = min(start + self._chunk, len(keys))
            with self._io_lock:
                found += self._get_chunk(keys[start:stop], start, place)
        with self._stats_lock:
            self._stats.hits += sum(found)
            self._stats.misses += len(found) - sum(found)
            self._stats.blocks_out += sum(found)
            self._stats.bytes_out += sum(found) * self._nbytes
        return found

    def _get_chunk(
        self, keys: Sequence[bytes], offset: int, place: Callable[[int, torch.Tensor], Any]
    ) -> list[bool]:
        staging = self._staging_rows(len(keys))
        tags = self._tag_rows(len(keys))
        if staging is None or tags is None:
            return [False] * len(keys)
        names = self._names(keys)
        addrs = self._addresses(staging, range(len(keys)))
        sizes = [self._nbytes] * len(keys)
        codes = self._native(lambda c: c.batch_get_into(names, addrs, sizes), len(keys))
        if codes is None:
            return [False] * len(keys)
        tag_names = [n + TAG_SUFFIX for n in names]
        tag_addrs = self._addresses(tags, range(len(keys)), TAG_BYTES)
        tag_codes = self._native(
            lambda c: c.batch_get_into(tag_names, tag_addrs, [TAG_BYTES] * len(keys)), len(keys)
        )
        if tag_codes is None:
            return [False] * len(keys)
        found = [rc == self._nbytes for rc in codes]
        forged = 0
        for i, ok in enumerate(found):
            if not ok:
                continue
            want = block_tag(self._tag_key, names[i], _row_view(staging[i]))
            if tag_codes[i] != TAG_BYTES or not hmac.compare_digest(want, bytes(tags[i].numpy())):
                found[i] = False
                forged += 1
                continue
            place(offset + i, staging[i])
        if forged:
            with self._stats_lock:
                self._stats.corrupt += forged
            log.warning(
                "KV store: %d block(s) failed their tag (written without the secret)", forged
            )
        codes = [
            rc if rc < 0 else t if t < 0 else rc for rc, t in zip(codes, tag_codes, strict=True)
        ]
        unsettled = sorted({rc for rc in codes if rc < 0 and rc not in _SETTLED_MISS})
        if any(rc not in _UNREACHABLE for rc in unsettled):
            self._retire_staging()
            self._fail(f"a read failed (Mooncake error {unsettled[0]})")
        elif unsettled:
            self._fail("the master is unreachable")
        elif any(found):
            self._succeeded()
        return found

    def _native(self, call: Callable[[Any], list[int]], n: int) -> list[int] | None:
        """Run one batch call of the client; None if the tier is down or the call failed."""
        client = self._conn.client
        if client is None:
            return None
        try:
            codes = list(call(client))
        except Exception as e:  # the binding raised: treated as an unreachable store
            self._fail(f"a call failed: {e}")
            return None
        if len(codes) != n:
            self._fail(f"{len(codes)} results for {n} keys")
            return None
        return codes

    def _dropped(self, n: int) -> list[bool]:
        with self._stats_lock:
            self._stats.drops += n
        return [False] * n

    def _addresses(
        self, t: torch.Tensor, rows: Sequence[int] | range, row_bytes: int = 0
    ) -> list[int]:
        base, size = t.data_ptr(), row_bytes or self._nbytes
        return [base + r * size for r in rows]

    # -- registered memory (under the I/O lock) ----------------------------------------------

    def _register(self, t: torch.Tensor) -> bool:
        client = self._conn.client
        if client is None:
            return False
        ptr = t.data_ptr()
        if ptr in self._registered:
            return True
        try:
            rc = client.register_buffer(ptr, t.numel())
        except Exception as e:
            rc = e
        if rc != 0:
            self._fail(f"could not register {t.numel()} bytes ({rc})")
            return False
        self._registered[ptr] = t
        return True

    def _unregister(self, t: torch.Tensor) -> None:
        client = self._conn.client
        if client is None:
            return  # still registered: it stays in `_registered`, alive, until close
        if self._registered.pop(t.data_ptr(), None) is not None:
            try:
                client.unregister_buffer(t.data_ptr())
            except Exception as e:
                log.debug("KV store: unregister_buffer: %s", e)

    def _staging_rows(self, n: int) -> torch.Tensor | None:
        """The first `n` rows of the staging buffer (grown to fit and registered); None if down."""
        self._reap()
        grown = self._grown(self._staging, n, self._nbytes)
        if grown is None:
            return None
        self._staging = grown
        return grown[:n]

    def _tag_rows(self, n: int) -> torch.Tensor | None:
        """The first `n` rows of the tag buffer (grown to fit and registered); None if down."""
        grown = self._grown(self._tags, max(n, self._chunk), TAG_BYTES)
        if grown is None:
            return None
        self._tags = grown
        return grown[:n]

    def _grown(self, buf: torch.Tensor | None, n: int, row_bytes: int) -> torch.Tensor | None:
        """`buf`, or a registered replacement of `n` rows (`buf` unregistered) when it has
        fewer; None if the store is down or the replacement cannot be registered (then `buf`
        stays as it is)."""
        if self._conn.client is None:
            return None
        if buf is not None and buf.shape[0] >= n:
            return buf
        fresh = torch.empty((n, row_bytes), dtype=torch.uint8)
        if not self._register(fresh):
            return None
        if buf is not None:
            self._unregister(buf)
        return fresh

    def _retire_staging(self) -> None:
        """Set the staging buffers aside, still registered, until any late write is over."""
        if self._staging is not None:
            self._retired.append((time.monotonic() + QUARANTINE_S, self._staging))
            self._staging = None
        if self._tags is not None:
            self._retired.append((time.monotonic() + QUARANTINE_S, self._tags))
            self._tags = None

    def _reap(self) -> None:
        now = time.monotonic()
        while self._retired and self._retired[0][0] <= now:
            self._unregister(self._retired.pop(0)[1])

    # -- outages -----------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        """Count an error and take the connection down: every call a miss until it answers."""
        with self._stats_lock:
            self._stats.errors += 1
        self._conn.fail(reason)

    def _succeeded(self) -> None:
        self._conn.succeeded()
