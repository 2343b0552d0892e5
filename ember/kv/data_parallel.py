"""The KV cache of an engine whose attention is data-parallel: one cache a rank, each request's
blocks all on one rank.

Each rank's cache is a `KVCacheManager` of its own (its pool, its prefix index, its eviction);
the engine sees one block-id space cut into equal runs, rank r's block i being id r * B + i, so a
request's block table names its rank (ember/engine/dp_attention.py). A request is placed when it
is admitted: on the rank holding the longest cached prefix of its prompt (an agent's next turn
returns to its conversation's rank), else on the rank with the most free blocks. It stays there
until it ends or is preempted, and is placed again when admitted again.

The interface is `KVCacheManager`'s, with the request named where a lookup places it, so the
scheduler runs one way for both."""

from __future__ import annotations

from collections.abc import Sequence

from ember.kv.block_hash import BlockHash
from ember.kv.block_pool import KVBlock
from ember.kv.eviction import Policy
from ember.kv.kv_cache_manager import KVCacheManager


class DataParallelKV:
    def __init__(
        self,
        num_ranks: int,
        blocks_per_rank: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        namespace: str = "",
        record_events: bool = False,
        eviction: Policy = "next-use",
    ) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.ranks = [
            KVCacheManager(
                blocks_per_rank,
                block_size,
                enable_prefix_caching,
                namespace,
                record_events,
                eviction=eviction,
            )
            for _ in range(num_ranks)
        ]
        self.blocks_per_rank = blocks_per_rank
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root = self.ranks[0].root
        self.pool = PoolsView(self.ranks, blocks_per_rank)
        self._rank: dict[str, int] = {}
        """Each placed request's rank."""

    @property
    def usage(self) -> float:
        return self.pool.usage

    def rank_of(self, request_id: str) -> int | None:
        return self._rank.get(request_id)

    def shares_room(self, a: str, b: str) -> bool:
        """Whether freeing request `a`'s blocks can make room for request `b`'s: both on one
        rank (the scheduler's choice of whom to preempt)."""
        return self._rank.get(a) == self._rank.get(b)

    def block_ids(self, request_id: str) -> list[int]:
        r = self._rank.get(request_id)
        if r is None:
            return []
        first = r * self.blocks_per_rank
        return [first + b for b in self.ranks[r].block_ids(request_id)]

    def num_blocks_of(self, request_id: str) -> int:
        r = self._rank.get(request_id)
        return 0 if r is None else self.ranks[r].num_blocks_of(request_id)

    def update_block_hashes(
        self, hashes: list[BlockHash], token_ids: Sequence[int], cache_salt: str | None
    ) -> list[BlockHash]:
        return self.ranks[0].update_block_hashes(hashes, token_ids, cache_salt)

    def get_computed_blocks(
        self,
        hashes: list[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None,
        request_id: str = "",
    ) -> tuple[list[KVBlock], int]:
        """Place request `request_id` (unless it holds blocks already) and return its rank's
        cached prefix, as `KVCacheManager.get_computed_blocks`."""
        r = self._rank.get(request_id)
        if r is not None and self.ranks[r].num_blocks_of(request_id):
            return self.ranks[r].get_computed_blocks(hashes, token_ids, cache_salt)
        found = [m.get_computed_blocks(hashes, token_ids, cache_salt) for m in self.ranks]
        # The longest hit, then the most room once its free hits are taken, then the first.
        r = max(
            range(len(self.ranks)),
            key=lambda i: (
                found[i][1],
                self.ranks[i].pool.num_free_blocks - sum(b.ref_cnt == 0 for b in found[i][0]),
                -i,
            ),
        )
        self._rank[request_id] = r
        return found[r]

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
    ) -> bool:
        r = self._rank.get(request_id)
        if r is None:  # never looked up (no prefix caching in its way): the roomiest rank
            r = max(range(len(self.ranks)), key=lambda i: self.ranks[i].pool.num_free_blocks)
            self._rank[request_id] = r
        return self.ranks[r].allocate_slots(
            request_id, num_computed_tokens, num_new_tokens, new_computed_blocks
        )

    def publish(
        self,
        request_id: str,
        hashes: list[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None,
        num_tokens: int,
    ) -> None:
        r = self._rank.get(request_id)
        if r is not None:
            self.ranks[r].publish(request_id, hashes, token_ids, cache_salt, num_tokens)

    def unpublish(self, request_id: str) -> None:
        r = self._rank.get(request_id)
        if r is not None:
            self.ranks[r].unpublish(request_id)

    def free(self, request_id: str) -> None:
        """Release a request's blocks; it is placed again if it comes back (preempted)."""
        r = self._rank.pop(request_id, None)
        if r is not None:
            self.ranks[r].free(request_id)


class PoolsView:
    """The ranks' pools seen as one, for the engine's statistics and events (block ids in the
    engine's space)."""

    def __init__(self, ranks: list[KVCacheManager], blocks_per_rank: int) -> None:
        self._pools = [m.pool for m in ranks]
        self.num_blocks = blocks_per_rank * len(ranks)

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks for p in self._pools)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(p.num_cached_blocks for p in self._pools)

    @property
    def num_evictions(self) -> int:
        return sum(p.num_evictions for p in self._pools)

    def drain_events(self) -> list[tuple[str, BlockHash]]:
        """Each rank's events, rank 0's first. A hash cached on two ranks and evicted from one
        is reported removed though the other still holds it: the router's prefix index is a
        hint, and the engine places a request by its own lookup."""
        return [ev for p in self._pools for ev in p.drain_events()]

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks:
            return False
        return all(p.reset_prefix_cache() for p in self._pools)
