"""The pool of KV blocks: reference counts, an LRU free queue, and the hash -> block prefix index.

A block whose reference count drops to zero keeps its hash and stays findable until it is evicted,
which happens only when the pool hands it out again (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from ember.kv.block_hash import BlockHash


class KVCacheError(RuntimeError):
    """An internal invariant of the KV cache was broken (a double free, an over-allocation)."""


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        record_events: bool = False,
        track_writes: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the front is evicted first.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        # KV events for the router's prefix index: hashes published and evicted, in order.
        self.record_events = record_events
        self.events: list[tuple[str, BlockHash]] = []
        """("stored" | "removed", hash), in the order they happened."""
        # For the KV tiers: blocks published (to copy down) and handed out (to fence) since the
        # last drain.
        self.track_writes = track_writes
        self._published: list[tuple[int, BlockHash]] = []
        self._allocated: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the eviction queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise KVCacheError(f"asked for {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, b = self._free.popitem(last=False)
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        if self.track_writes:
            self._allocated.extend(b.block_id for b in out)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass blocks in the order they should be evicted."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise KVCacheError(f"double free of block {b.block_id}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = b

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Publish a full block under its hash (first writer wins for duplicate content)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        if block_hash not in self._cached:
            self._cached[block_hash] = block
            if self.record_events:
                self.events.append(("stored", block_hash))
            if self.track_writes:
                self._published.append((block.block_id, block_hash))

    def drain_events(self) -> list[tuple[str, BlockHash]]:
        """The events since the last call."""
        out, self.events = self.events, []
        return out

    def drain_published(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the blocks published since the last call (with `track_writes`)."""
        out, self._published = self._published, []
        return out

    def drain_allocated(self) -> list[int]:
        """Ids of the blocks handed out since the last call (with `track_writes`)."""
        out, self._allocated = self._allocated, []
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        if self.record_events:
            self.events.extend(("removed", h) for h in self._cached)
        for b in self.blocks:
            b.block_hash = None
        self._cached.clear()
        return True

    def uncache(self, b: KVBlock) -> None:
        """Forget `b`'s hash (its KV can no longer be trusted); the block stays allocated."""
        self._evict(b)

    def _evict(self, b: KVBlock) -> None:
        if b.block_hash is None:
            return
        if self._cached.get(b.block_hash) is b:
            del self._cached[b.block_hash]
            self.num_evictions += 1
            if self.record_events:
                self.events.append(("removed", b.block_hash))
        b.block_hash = None
