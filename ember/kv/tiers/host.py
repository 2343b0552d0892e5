"""The host tier: KV blocks in (pinned) CPU memory, a slot per block, an eviction policy over the
slots (ember/kv/eviction.py: by default each block's predicted next use, learned from `touch`).

It is both a cache and the staging area of every other move: GPU -> host -> disk / store and back.
An entry is reserved (a slot to write into, invisible to lookups), then committed (visible) or
aborted; pinned entries (being read or written elsewhere) and reserved ones are never evicted. Every
method takes the tier's lock: the engine thread and the tier manager's background thread share it.
On a GPU the memory grows in the background (host_memory.py): slots are handed out only once their
chunk is there, so the capacity is what is allocated so far.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ember.kv.eviction import Policy, make_policy
from ember.kv.tiers.base import BlockLayout, EventLog, Medium, TierStats
from ember.kv.tiers.host_memory import CHUNK_BYTES, HostMemory

if TYPE_CHECKING:
    from ember.kv.tiers.host_memory import Allocate, Pace


class HostTier:
    medium: Medium = "cpu"

    def __init__(
        self,
        layout: BlockLayout,
        capacity_blocks: int,
        pin: bool,
        chunk_bytes: int = CHUNK_BYTES,
        background: bool | None = None,
        allocate: Allocate | None = None,
        pace: Pace = "busy",
        eviction: Policy = "next-use",
        memory: HostMemory | None = None,
    ) -> None:
        """`capacity_blocks`: the size it grows to; `pin`, `chunk_bytes`, `background`,
        `allocate` and `pace`: how its memory is allocated (see HostMemory), unless `memory`
        (started earlier, of `capacity_blocks` rows of the layout's bytes) is given; `eviction`:
        which committed entry goes first when room is needed."""
        if capacity_blocks < 1:
            raise ValueError(f"the host tier needs at least 1 block, got {capacity_blocks}")
        self.layout = layout
        self.target_blocks = capacity_blocks
        self._lock = threading.RLock()
        self._entries: dict[bytes, int] = {}  # committed
        self.policy = make_policy(eviction)
        """Over the committed entries' slots; grown with the memory."""
        self._reserved: dict[bytes, int] = {}
        self._pins: dict[bytes, int] = {}
        self._free: list[int] = []  # pop() gives the lowest free slot of the oldest chunk first
        self._stats = TierStats()
        self.events = EventLog("cpu")
        """Commits ("stored") and evictions ("removed"), when the manager turns them on."""
        if memory is not None:
            if (memory.row_bytes, memory.target_rows) != (layout.nbytes, capacity_blocks):
                raise ValueError(
                    f"the host memory holds {memory.target_rows} rows of {memory.row_bytes} "
                    f"bytes, not {capacity_blocks} of {layout.nbytes}"
                )
            self.memory = memory
            memory.attach(self._grown)
        else:
            self.memory = HostMemory(
                layout.nbytes,
                capacity_blocks,
                pin,
                chunk_bytes,
                background,
                allocate,
                self._grown,
                pace,
            )

    @property
    def capacity_blocks(self) -> int:
        """Blocks it holds now: only the memory allocated so far."""
        return self.memory.num_rows

    def row(self, slot: int) -> torch.Tensor:
        """The bytes of a slot: a uint8 [nbytes] view."""
        return self.memory.row(slot)

    def close(self) -> None:
        """Stop growing."""
        self.memory.close()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def holds(self, key: bytes) -> bool:
        """Whether the key is here or being written here (committed or reserved)."""
        with self._lock:
            return key in self._entries or key in self._reserved

    def lookup(self, key: bytes) -> int | None:
        """The slot of a committed entry; None if absent (a use is told by `touch`)."""
        with self._lock:
            return self._entries.get(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        """A request used these blocks (its prompt's, in order), wherever they were read from:
        what the eviction policy learns reuse from. Keys not here keep the use for later."""
        with self._lock:
            self.policy.touch(keys)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first on, are committed here (without touching them)."""
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._entries:
                    break
                n += 1
            return n

    def reserve(self, keys: Sequence[bytes]) -> list[int | None]:
        """A slot per key to write into, evicting unpinned entries in the policy's order for room.

        None for a key that is already here (committed or reserved) or when nothing is left to
        evict. A reserved entry is invisible until `commit` and is never evicted.
        """
        with self._lock:
            new = sum(
                1 for key in set(keys) if key not in self._entries and key not in self._reserved
            )
            if new > len(self._free):
                self._evict(new - len(self._free))
            out: list[int | None] = []
            for key in keys:
                if key in self._entries or key in self._reserved or not self._free:
                    out.append(None)
                    continue
                slot = self._free.pop()
                self._reserved[key] = slot
                out.append(slot)
            return out

    def commit(self, keys: Sequence[bytes]) -> None:
        """Make reserved entries visible (as the most recently used)."""
        with self._lock:
            for key in keys:
                slot = self._reserved.pop(key, None)
                if slot is None:
                    raise KeyError(f"commit of a key that is not reserved: {key.hex()[:16]}")
                self._entries[key] = slot
                self.policy.place(slot, key)
                self._stats.blocks_in += 1
            self.events.record("stored", keys)

    def abort(self, keys: Sequence[bytes]) -> None:
        """Give reserved slots back (their writes failed or were cancelled)."""
        with self._lock:
            for key in keys:
                slot = self._reserved.pop(key, None)
                if slot is None:
                    raise KeyError(f"abort of a key that is not reserved: {key.hex()[:16]}")
                self._free.append(slot)
                self._pins.pop(key, None)

    def pin(self, keys: Sequence[bytes]) -> None:
        """Keep entries (committed or reserved) from eviction until as many `unpin` calls."""
        with self._lock:
            for key in keys:
                if key not in self._entries and key not in self._reserved:
                    raise KeyError(f"pin of a key that is not here: {key.hex()[:16]}")
                self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                count = self._pins.get(key, 0)
                if count == 0:
                    raise KeyError(f"unpin of a key that is not pinned: {key.hex()[:16]}")
                if count == 1:
                    del self._pins[key]
                else:
                    self._pins[key] = count - 1

    def is_pinned(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pins

    def count_reads(self, hits: int) -> None:
        """Blocks a load found here (and read out); misses are counted at lookup, by the
        manager."""
        with self._lock:
            self._stats.hits += hits
            self._stats.blocks_out += hits
            self._stats.bytes_out += hits * self.layout.nbytes

    def stats(self) -> TierStats:
        with self._lock:
            s = self._stats.copy()
            s.occupancy_blocks = len(self._entries)
            s.occupancy_bytes = len(self._entries) * self.layout.nbytes
            s.bytes_in = s.blocks_in * self.layout.nbytes
            s.capacity_bytes = self.capacity_blocks * self.layout.nbytes
            return s

    def _grown(self, first: int, n: int) -> None:
        """A chunk arrived: its slots are free to hand out."""
        with self._lock:
            self.policy.resize(first + n)
            self._free[:0] = range(first + n - 1, first - 1, -1)

    def _evict(self, n: int) -> None:
        """Free up to `n` unpinned committed entries, in the policy's order."""
        pinned = {self._entries[key] for key in self._pins if key in self._entries}
        gone: list[bytes] = []
        for slot in self.policy.victims(n, exclude=pinned):
            key = self.policy.key_of(slot)
            del self._entries[key]
            self.policy.clear(slot)
            self._free.append(slot)
            gone.append(key)
        self._stats.evictions += len(gone)
        if gone:
            self.events.record("removed", gone)
