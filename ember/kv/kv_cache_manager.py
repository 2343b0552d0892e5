"""Per-request block tables over the block pool: prefix-cache lookup, slot allocation, freeing.

It knows requests only by id and plain values (token ids, the list of block hashes the caller keeps
for them, a cache salt, token counts), so `kv/` needs nothing from the engine above it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ember.kv.block_hash import BlockHash, hash_blocks, root_hash
from ember.kv.block_pool import BlockPool, KVBlock
from ember.kv.eviction import Policy


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        namespace: str = "",
        record_events: bool = False,
        track_writes: bool = False,
        eviction: Policy = "next-use",
    ) -> None:
        """`track_writes`: remember the blocks published and allocated since the last
        `drain_published` / `drain_allocated` (the KV tiers copy the first and fence the second)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(
            num_blocks, enable_prefix_caching, record_events, track_writes, eviction
        )
        self.root = root_hash(namespace)
        self._blocks: dict[str, list[KVBlock]] = {}
        # How many of a request's blocks are already published in the prefix index.
        self._num_published: dict[str, int] = {}

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def update_block_hashes(
        self, hashes: list[BlockHash], token_ids: Sequence[int], cache_salt: str | None
    ) -> list[BlockHash]:
        """Extend `hashes` (in place) to cover every full block of `token_ids`; returns it."""
        n = len(hashes)
        parent = hashes[-1] if n else self.root
        extra = (cache_salt,) if cache_salt else None
        hashes.extend(hash_blocks(parent, token_ids, self.block_size, n, first_extra_keys=extra))
        return hashes

    def shares_room(self, a: str, b: str) -> bool:
        """Whether freeing request `a`'s blocks makes room for request `b`'s: always, in one
        pool (ember/kv/data_parallel.py has several)."""
        return True

    def get_computed_blocks(
        self,
        hashes: list[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None,
        request_id: str = "",
    ) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of `token_ids` in whole blocks, leaving at least one token to
        compute; `hashes` is extended as `update_block_hashes` does. `request_id`, the request
        it is for, places the request where a cache has several pools (here, one)."""
        if not self.enable_prefix_caching:
            return [], 0
        self.update_block_hashes(hashes, token_ids, cache_salt)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` after the computed ones (`num_computed_tokens`, plus
        those of the cache hits `new_computed_blocks`); False (and no change) if full. Nothing is
        published: the caller `publish`es the blocks once their KV is known to be written."""
        hits = new_computed_blocks or []
        blocks = self._blocks.get(request_id, [])
        total = num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - len(blocks) - len(hits)
        # Hits sitting in the free queue stop being free once touched.
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - free_hits:
            return False
        self.pool.touch(hits)
        blocks = self._blocks.setdefault(request_id, blocks)
        blocks.extend(hits)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

    def publish(
        self,
        request_id: str,
        hashes: list[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None,
        num_tokens: int,
    ) -> None:
        """Publish the full blocks of the first `num_tokens` of `token_ids` in the prefix index,
        now that their KV is written (or, for a step being scheduled, will be before any attention
        reads it). `hashes` is extended as `update_block_hashes` does."""
        if not self.enable_prefix_caching:
            return
        # A block whose last token is still in flight (a placeholder) has no hash yet: it is
        # published by a later step, once the token is known.
        full = min(num_tokens, len(token_ids)) // self.block_size
        start = self._num_published.get(request_id, 0)
        if full <= start:
            return
        blocks = self._blocks.get(request_id, [])
        self.update_block_hashes(hashes, token_ids, cache_salt)
        for i in range(start, full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_published[request_id] = full

    def unpublish(self, request_id: str) -> None:
        """Take a request's blocks out of the prefix index: a step that failed may not have
        written the KV of blocks it published at scheduling time."""
        for b in self._blocks.get(request_id, ()):
            self.pool.uncache(b)
        self._num_published.pop(request_id, None)

    def free(self, request_id: str) -> None:
        """Release every block of a request (a use of its cached ones: see BlockPool.free)."""
        blocks = self._blocks.pop(request_id, None)
        self._num_published.pop(request_id, None)
        if blocks:
            self.pool.free(blocks)
