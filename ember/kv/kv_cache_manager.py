"""Per-request block tables over the block pool: prefix-cache lookup, slot allocation, freeing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ember.kv.block_hash import BlockHash, hash_blocks, root_hash
from ember.kv.block_pool import BlockPool, KVBlock

if TYPE_CHECKING:
    from ember.engine.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        namespace: str = "",
        record_events: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching, record_events)
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

    def update_block_hashes(self, req: Request) -> list[BlockHash]:
        """Extend `req.block_hashes` to cover every full block of its known tokens."""
        n = len(req.block_hashes)
        parent = req.block_hashes[-1] if n else self.root
        extra = (req.cache_salt,) if req.cache_salt else None
        req.block_hashes.extend(
            hash_blocks(parent, req.all_token_ids, self.block_size, n, first_extra_keys=extra)
        )
        return req.block_hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of `req` in whole blocks, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self.update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        publish: bool = True,
    ) -> bool:
        """Make room for `num_new_tokens` after the computed ones; False (and no change) if full.

        Blocks that the step will fill completely are published in the prefix index at once: their
        KV is written before any attention reads it within the same forward pass. Blocks filled
        some other way (read from a remote engine) pass publish=False and `publish` once written.
        """
        hits = new_computed_blocks or []
        blocks = self._blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_new_tokens
        need = -(-total // self.block_size) - len(blocks) - len(hits)
        # Hits sitting in the free queue stop being free once touched.
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - free_hits:
            return False
        self.pool.touch(hits)
        blocks = self._blocks.setdefault(req.request_id, blocks)
        blocks.extend(hits)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        if publish:
            self._publish(req, blocks, total)
        return True

    def publish(self, req: Request, num_tokens: int) -> None:
        """Publish the full blocks of the first `num_tokens` tokens, now that their KV is written."""
        self._publish(req, self._blocks.get(req.request_id, []), num_tokens)

    def unpublish(self, req: Request) -> None:
        """Take `req`'s blocks out of the prefix index: a step that failed may not have written
        the KV of blocks it published at scheduling time."""
        for b in self._blocks.get(req.request_id, ()):
            self.pool.uncache(b)
        self._num_published.pop(req.request_id, None)

    def free(self, req: Request) -> None:
        """Release every block of `req`; tail blocks go to the eviction queue first."""
        blocks = self._blocks.pop(req.request_id, None)
        self._num_published.pop(req.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def _publish(self, req: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        # A block whose last token is still in flight (a placeholder) has no hash yet: it is
        # published by a later step, once the token is known.
        full = min(num_tokens, req.num_tokens) // self.block_size
        start = self._num_published.get(req.request_id, 0)
        if full <= start:
            return
        hashes = self.update_block_hashes(req)
        for i in range(start, full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_published[req.request_id] = full
