"""The disk tier: one file per KV block in a local directory, kept across restarts.

A block lives at `<dir>/<first key byte hex>/<key hex>.kv`: a header (magic, the layout's
fingerprint, the key, the payload length, a tag), then the block's bytes. The tag is BLAKE2b-128
keyed by the directory's own secret (`.ember-kv-key`, 0600) over the block's key and payload: a
torn write, a block renamed to another key, or a forged file with a recomputed checksum all fail
it on read, and the entry is deleted and reported as a miss (recomputed). Files are written to a
temporary name and renamed, so a reader never sees half a write.

The directory is ember's: created 0700 with a marker file (`.ember-kv-disk`), or adopted only if
empty. A directory holding anything else is refused, and nothing ember did not write is ever
deleted. Block files are 0600. At start-up the index is rebuilt from the headers, least recently
used first by modification time (a read touches it); entries of another layout are left alone and
not counted, leftover temporary files are removed. The capacity is the smaller of the budget and
what the filesystem has free (checked as blocks are written); a write that fails is counted and
logged at most once an interval. One engine owns a directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import struct
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ember.kv.eviction import Policy, make_policy
from ember.kv.tiers.base import BlockLayout, EventLog, Medium, Tier, TierStats, check_rows

if TYPE_CHECKING:
    from ember.kv.tiers.host_memory import HostMemory

log = logging.getLogger(__name__)

MAGIC = b"EMBERKV\x02"
# magic, layout fingerprint (16 bytes), key length, payload length, keyed tag (16 bytes)
HEADER = struct.Struct("<8s16sHQ16s")
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
MARKER = ".ember-kv-disk"
MARKER_TEXT = "ember KV disk tier: every file here is ember's to replace or delete\n"
KEY_FILE = ".ember-kv-key"
_SUBDIR = re.compile(r"[0-9a-f]{2}")
_TMP_NAME = re.compile(r"[0-9a-f]+\.kv\.[0-9a-f]{8}\.tmp")
FREE_CHECK_S = 1.0
"""How often the filesystem's free space is read (a statvfs, ~2 us)."""
FREE_RESERVE_BYTES = 256 << 20
"""Room left on the filesystem for everything else."""
ERROR_LOG_INTERVAL_S = 30.0


class DiskDirError(ValueError):
    """The directory given for the disk tier cannot be ember's (it holds other files)."""


def tag(secret: bytes, key: bytes, payload: memoryview) -> bytes:
    """The block's tag: BLAKE2b-128 keyed by the directory's secret, over its key and bytes."""
    h = hashlib.blake2b(key, digest_size=16, key=secret)
    h.update(payload)
    return h.digest()


def claim_directory(root: Path) -> bytes:
    """Make `root` the disk tier's own (create it 0700, or adopt it if empty, with the marker and
    a fresh secret) or check that it is already; returns the directory's secret. Raises
    DiskDirError for a directory of anything else: it is never written into or deleted from."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    marker, key_file = root / MARKER, root / KEY_FILE
    if not marker.exists():
        others = sorted(p.name for p in root.iterdir())
        if others:
            raise DiskDirError(
                f"--kv-disk-dir {root} is not an ember KV directory (no {MARKER}) and is not "
                f"empty ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): give an "
                "empty or new directory"
            )
        os.chmod(root, 0o700)
        _write_private(key_file, secrets.token_bytes(32))
        _write_private(marker, MARKER_TEXT.encode())
    try:
        secret = key_file.read_bytes()
    except OSError as e:
        raise DiskDirError(f"--kv-disk-dir {root}: cannot read its key {KEY_FILE}: {e}") from e
    if len(secret) != 32:
        raise DiskDirError(f"--kv-disk-dir {root}: its key {KEY_FILE} is not 32 bytes")
    return secret


def _write_private(path: Path, *parts: bytes | memoryview) -> None:
    """A new file (never an existing one) only our user may read, holding `parts` in order."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        for part in parts:
            f.write(part)


def _row_bytes(row: torch.Tensor) -> memoryview:
    """The bytes of one uint8 row, without a copy (writable for reads into it)."""
    return memoryview(row.numpy()).cast("B")


class DiskTier(Tier):
    medium: Medium = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        layout: BlockLayout,
        eviction: Policy = "next-use",
    ):
        """`eviction`: which entry goes first when room is needed (ember/kv/eviction.py); every
        entry has the same size, so each is a slot of the policy."""
        self.root = Path(path)
        self._secret = claim_directory(self.root)
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        """The budget; what may be used is also bounded by the filesystem's free space."""
        self._fingerprint = bytes.fromhex(layout.fingerprint())
        self._lock = threading.Lock()
        self._free_checked = -FREE_CHECK_S
        self._room = capacity_bytes
        self._failed_writes = 0
        """Write failures not yet logged (logged at most once per ERROR_LOG_INTERVAL_S)."""
        self._last_error_log = -ERROR_LOG_INTERVAL_S
        self._index: dict[bytes, int] = {}  # key -> file size
        self.policy = make_policy(eviction)
        self._slots: dict[bytes, int] = {}  # key -> the policy's slot
        self._free_slots: list[int] = []
        self._used = 0
        self._stats = TierStats(capacity_bytes=capacity_bytes)
        self.events = EventLog("disk")
        """Puts ("stored"), evictions and corrupt deletions ("removed"), when turned on."""
        self._rebuild()

    # -- the Tier interface ------------------------------------------------------------------

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._index:
                    break
                n += 1
            return n

    def put(self, keys: Sequence[bytes], src: torch.Tensor) -> list[bool]:
        check_rows(src, len(keys), self.layout.nbytes, "src")
        return [self._put_one(key, src[i]) for i, key in enumerate(keys)]

    def put_rows(
        self, keys: Sequence[bytes], memory: HostMemory, slots: Sequence[int]
    ) -> list[bool]:
        return [self._put_one(key, memory.row(s)) for key, s in zip(keys, slots, strict=True)]

    def get_into(self, keys: Sequence[bytes], dst: torch.Tensor) -> list[bool]:
        check_rows(dst, len(keys), self.layout.nbytes, "dst")
        return [self._get_one(key, dst[i]) for i, key in enumerate(keys)]

    def get_into_rows(
        self, keys: Sequence[bytes], memory: HostMemory, slots: Sequence[int]
    ) -> list[bool]:
        return [self._get_one(key, memory.row(s)) for key, s in zip(keys, slots, strict=True)]

    def stats(self) -> TierStats:
        with self._lock:
            s = self._stats.copy()
            s.occupancy_blocks = len(self._index)
            s.occupancy_bytes = self._used
            return s

    # -- files -------------------------------------------------------------------------------

    def path_of(self, key: bytes) -> Path:
        return self.root / key[:1].hex() / (key.hex() + SUFFIX)

    def _entry_size(self, key: bytes) -> int:
        return HEADER.size + len(key) + self.layout.nbytes

    def _put_one(self, key: bytes, row: torch.Tensor) -> bool:
        size = self._entry_size(key)
        with self._lock:
            if key in self._index:
                return True
            if size > self._usable_bytes():
                self._stats.drops += 1
                return False
            victims = self._make_room(size)
        for victim in victims:
            self._unlink(self.path_of(victim))
        self.events.record("removed", victims)
        payload = _row_bytes(row)
        digest = tag(self._secret, key, payload)
        header = HEADER.pack(MAGIC, self._fingerprint, len(key), len(payload), digest)
        path = self.path_of(key)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            _write_private(tmp, header, key, payload)
            os.replace(tmp, path)
        except OSError as e:
            self._unlink(tmp)
            with self._lock:
                self._used -= size
                self._stats.errors += 1
                self._stats.drops += 1
                self._free_checked = -FREE_CHECK_S  # a full disk: read the free space again
            self._log_write_failure(path, e)
            return False
        with self._lock:
            self._add(key, size)
            self._stats.blocks_in += 1
            self._stats.bytes_in += len(payload)
        self.events.record("stored", [key])
        return True

    def _usable_bytes(self) -> int:
        """The budget, or less when the filesystem has less free (what we hold counts as ours:
        used + free - reserve). Read at most every FREE_CHECK_S. Under the lock."""
        now = time.monotonic()
        if now - self._free_checked >= FREE_CHECK_S:
            self._free_checked = now
            try:
                st = os.statvfs(self.root)
                free = st.f_bavail * st.f_frsize
                self._room = max(
                    0, min(self.capacity_bytes, self._used + free - FREE_RESERVE_BYTES)
                )
            except OSError:
                self._room = self.capacity_bytes
        return self._room

    def _log_write_failure(self, path: Path, e: OSError) -> None:
        """One warning per interval, however many writes fail (a full disk fails them all)."""
        now = time.monotonic()
        with self._lock:
            self._failed_writes += 1
            if now - self._last_error_log < ERROR_LOG_INTERVAL_S:
                return
            count, self._failed_writes = self._failed_writes, 0
            self._last_error_log = now
        log.warning(
            "disk tier: %d block write(s) failed in the last %.0f s, the last %s: %s",
            count,
            ERROR_LOG_INTERVAL_S,
            path,
            e,
        )

    def _make_room(self, size: int) -> list[bytes]:
        """Drop entries from the index, in the policy's order, until `size` more bytes fit,
        and count the bytes as used; the caller deletes the victims' files. Under the lock."""
        victims = []
        limit = self._usable_bytes()
        while self._used + size > limit and self._index:
            over = self._used + size - limit
            entry = self._entry_size(next(iter(self._index)))
            slots = self.policy.victims(-(-over // entry))
            if not slots:
                break
            for slot in slots:
                key = self.policy.key_of(slot)
                self._used -= self._remove(key)
                self._stats.evictions += 1
                victims.append(key)
        self._used += size
        return victims

    def touch(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self.policy.touch(keys)

    def _add(self, key: bytes, size: int, last: float | None = None) -> None:
        """Index an entry and give it a slot of the policy. Under the lock."""
        self._index[key] = size
        if not self._free_slots:  # twice as many slots: growing one at a time copies quadratically
            first = self.policy.num_slots
            self.policy.resize(max(64, 2 * first))
            self._free_slots.extend(range(self.policy.num_slots - 1, first - 1, -1))
        slot = self._free_slots.pop()
        self._slots[key] = slot
        self.policy.place(slot, key, last=last)

    def _remove(self, key: bytes) -> int:
        """Take an entry out of the index and its slot back; its size. Under the lock."""
        slot = self._slots.pop(key)
        self.policy.clear(slot)
        self._free_slots.append(slot)
        return self._index.pop(key)

    def _get_one(self, key: bytes, row: torch.Tensor) -> bool:
        with self._lock:
            known = key in self._index
        if not known:
            self._count_read(False)
            return False
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                ok = self._read_entry(f, key, _row_bytes(row))
            if ok:
                os.utime(path)
        except OSError as e:
            log.warning("disk tier: cannot read %s: %s", path, e)
            ok = False
        if not ok:
            self._drop_corrupt(key, path)
        self._count_read(ok)
        return ok

    def _read_entry(self, f, key: bytes, out: memoryview) -> bool:  # noqa: ANN001 - a binary file
        """Read one entry's payload into `out`; False if its header, length or checksum is wrong."""
        head = f.read(HEADER.size + len(key))
        if len(head) != HEADER.size + len(key):
            return False
        magic, fingerprint, key_len, length, digest = HEADER.unpack_from(head)
        if (
            magic != MAGIC
            or fingerprint != self._fingerprint
            or key_len != len(key)
            or head[HEADER.size :] != key
            or length != len(out)
        ):
            return False
        if f.readinto(out) != length or f.read(1):
            return False
        return secrets.compare_digest(tag(self._secret, key, out), digest)

    def _drop_corrupt(self, key: bytes, path: Path) -> None:
        log.warning("disk tier: dropping a truncated or corrupt entry %s", path)
        with self._lock:
            size = self._remove(key) if key in self._index else None
            if size is not None:
                self._used -= size
            self._stats.corrupt += 1
        self._unlink(path)
        if size is not None:
            self.events.record("removed", [key])

    def _count_read(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self._stats.hits += 1
                self._stats.blocks_out += 1
                self._stats.bytes_out += self.layout.nbytes
            else:
                self._stats.misses += 1

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("disk tier: cannot delete %s: %s", path, e)

    # -- start-up ----------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index this layout's entries from their headers, oldest first; remove temporary files
        and entries of this layout that are short or unreadable; leave other layouts' alone."""
        found: list[tuple[float, bytes, int]] = []
        for sub in self.root.iterdir():
            if not sub.is_dir() or not _SUBDIR.fullmatch(sub.name):
                continue
            for path in sub.iterdir():
                if _TMP_NAME.fullmatch(path.name):
                    self._unlink(path)
                elif path.name.endswith(SUFFIX):
                    entry = self._scan(path)
                    if entry is not None:
                        found.append(entry)
        found.sort()
        # Their last uses as the files' times say, on the policy's clock.
        now_wall, now = time.time(), self.policy.clock()
        for mtime, key, size in found:
            self._add(key, size, last=now - max(now_wall - mtime, 0.0))
            self._used += size
        for victim in self._make_room(0):
            self._unlink(self.path_of(victim))
        if found:
            log.info(
                "disk tier: %d blocks (%.1f MiB) found in %s",
                len(found),
                self._used / 2**20,
                self.root,
            )

    def _scan(self, path: Path) -> tuple[float, bytes, int] | None:
        """(mtime, key, size) of one of this layout's complete entries; None otherwise."""
        try:
            key = bytes.fromhex(path.name.removesuffix(SUFFIX))
        except ValueError:
            return None  # not a file of ours
        try:
            st = path.stat()
            with open(path, "rb") as f:
                head = f.read(HEADER.size + len(key))
        except OSError:
            return None
        if len(head) == HEADER.size + len(key):
            magic, fingerprint, key_len, length, _ = HEADER.unpack_from(head)
            if magic == MAGIC and fingerprint != self._fingerprint:
                return None  # another model or layout: not ours to count or delete
            if (
                magic == MAGIC
                and key_len == len(key)
                and head[HEADER.size :] == key
                and length == self.layout.nbytes
                and st.st_size == self._entry_size(key)
            ):
                return st.st_mtime, key, st.st_size
        self._stats.corrupt += 1
        self._unlink(path)
        return None
