"""The pool of KV blocks: reference counts, the free blocks, and the hash -> block prefix index.

A block whose reference count drops to zero keeps its hash and stays findable until it is evicted,
which happens only when the pool hands it out again: free blocks with no hash first (in the order
they were freed), then cached ones in the order of the eviction policy (ember/kv/eviction.py), which
learns each block's reuse from the requests that free it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from ember.kv.block_hash import BlockHash
from ember.kv.eviction import Policy, make_policy


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
        eviction: Policy = "next-use",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks with no hash, in the order they are handed out (the front first); free
        # cached blocks are the policy's residents, handed out in its order.
        self._plain: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.policy = make_policy(eviction, num_blocks, clock)
        self._num_free_cached = 0
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
        return len(self._plain) + self._num_free_cached

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def free_blocks(self) -> Iterator[KVBlock]:
        """The blocks no request holds (tests, tools)."""
        return (b for b in self.blocks if b.ref_cnt == 0)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the eviction order."""
        for b in blocks:
            if b.ref_cnt == 0:
                self._take(b)
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise KVCacheError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        while len(out) < n and self._plain:
            out.append(self._plain.popitem(last=False)[1])
        if len(out) < n:
            for block_id in self.policy.victims(n - len(out)):
                b = self.blocks[block_id]
                self._take(b)
                out.append(b)
        if len(out) < n:  # the policy and the counts disagree: a bug, not a full pool
            raise KVCacheError(f"the eviction policy gave {len(out)} of {n} free blocks")
        for b in out:
            self._evict(b)
            b.ref_cnt = 1
        if self.track_writes:
            self._allocated.extend(b.block_id for b in out)
        return out

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference each; `blocks` a request's, in order: this is a use of its cached
        ones, and the deeper of the blocks the policy counts alike are evicted first."""
        keys = [b.block_hash for b in blocks if b.block_hash is not None]
        if keys:
            self.policy.touch(keys)
        for depth, b in enumerate(blocks):
            if b.ref_cnt <= 0:
                raise KVCacheError(f"double free of block {b.block_id}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._give(b, depth)

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
        if self.num_free_blocks != self.num_blocks:
            return False
        if self.record_events:
            self.events.extend(("removed", h) for h in self._cached)
        for b in self.blocks:
            self._take(b)
            b.block_hash = None
            self._plain[b.block_id] = b
        self._cached.clear()
        return True

    def uncache(self, b: KVBlock) -> None:
        """Forget `b`'s hash (its KV can no longer be trusted); a free block stays free."""
        if b.ref_cnt == 0:
            self._take(b)
            self._evict(b)
            self._plain[b.block_id] = b
        else:
            self._evict(b)

    def _give(self, b: KVBlock, depth: int) -> None:
        """A block no request holds any more: cached ones to the policy, the rest to reuse."""
        if b.block_hash is not None and self._cached.get(b.block_hash) is b:
            self.policy.place(b.block_id, b.block_hash, depth)
            self._num_free_cached += 1
        else:
            self._plain[b.block_id] = b

    def _take(self, b: KVBlock) -> None:
        """A free block leaves the free ones (to be used or reused)."""
        if self._plain.pop(b.block_id, None) is None and self.policy.holds(b.block_id):
            self.policy.clear(b.block_id)
            self._num_free_cached -= 1

    def _evict(self, b: KVBlock) -> None:
        if b.block_hash is None:
            return
        if self._cached.get(b.block_hash) is b:
            del self._cached[b.block_hash]
            self.num_evictions += 1
            if self.record_events:
                self.events.append(("removed", b.block_hash))
        b.block_hash = None
