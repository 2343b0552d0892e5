"""The router's index of which endpoint holds which KV blocks, fed by the engines' KV events: one
`PrefixIndex` per medium an engine keeps to itself (GPU, host, disk), and a `StoreIndex` of the
blocks in shared KV stores, which every engine on that store can load.

Keys are chained block hashes (`ember.kv.block_hash`): block i's hash covers the whole prefix up to
block i, so matching a prompt is a walk over its hashes until the first block nobody holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.kv.block_hash import BlockHash


class PrefixIndex:
    """Block hash -> urls holding it, and url -> its hashes (so `forget` is O(its blocks)).

    `max_blocks_per_url` bounds what one url may hold here (its oldest stored blocks go first):
    a GPU's index is bounded by the engine's own evictions, a disk tier may hold millions of
    small blocks. Forgetting a block the engine still has costs one reuse, never a wrong answer.
    """

    __slots__ = ("_holders", "_blocks", "max_blocks_per_url")

    def __init__(self, max_blocks_per_url: int | None = None) -> None:
        if max_blocks_per_url is not None and max_blocks_per_url < 1:
            raise ValueError(f"max_blocks_per_url must be >= 1, got {max_blocks_per_url}")
        self._holders: dict[BlockHash, set[str]] = {}
        self._blocks: dict[str, dict[BlockHash, None]] = {}  # insertion order: oldest first
        self.max_blocks_per_url = max_blocks_per_url

    def __len__(self) -> int:
        """Distinct blocks held anywhere."""
        return len(self._holders)

    def num_blocks(self, url: str) -> int:
        return len(self._blocks.get(url, ()))

    def apply(self, url: str, stored: Iterable[BlockHash], removed: Iterable[BlockHash]) -> None:
        """One batch of `url`'s KV events. A hash in both lists ends removed: a false hit would
        draw requests to an endpoint that must recompute, a false miss only costs one reuse."""
        blocks = self._blocks.setdefault(url, {})
        for h in stored:
            if h in blocks:
                del blocks[h]  # stored again: now the newest
            else:
                self._holders.setdefault(h, set()).add(url)
            blocks[h] = None
        for h in removed:
            self._drop(url, h, blocks)
        cap = self.max_blocks_per_url
        while cap is not None and len(blocks) > cap:
            self._drop(url, next(iter(blocks)), blocks)
        if not blocks:
            del self._blocks[url]

    def forget(self, url: str) -> None:
        """Drop everything `url` held: it died, restarted, or cleared its cache."""
        blocks = self._blocks.pop(url, {})
        for h in list(blocks):
            self._drop(url, h, blocks)

    def _drop(self, url: str, h: BlockHash, blocks: dict[BlockHash, None]) -> None:
        if h not in blocks:
            return  # an eviction we never saw stored (events lost or replayed): nothing to undo
        del blocks[h]
        holders = self._holders[h]
        holders.discard(url)
        if not holders:
            del self._holders[h]

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each endpoint holding the first block: how many leading blocks of `hashes` it holds,
        stopping at its first miss (a block without its parent is useless). Endpoints holding no
        leading block are absent; read the result with `.get(url, 0)`."""
        out: dict[str, int] = {}
        if not hashes:
            return out
        alive = set(self._holders.get(hashes[0], ()))
        for i, h in enumerate(hashes[1:], start=1):
            if not alive:
                return out
            holders = self._holders.get(h, ())
            for url in alive.difference(holders):
                out[url] = i
            alive.intersection_update(holders)
        for url in alive:
            out[url] = len(hashes)
        return out


class StoreIndex:
    """Blocks known to be in each shared KV store (by the address engines give for it), as hints.

    An engine that writes through to a store reports every block it computes or loads as stored;
    each such block is written to its store in the background (or dropped, when the store is
    down or the engine's write backlog is full). The store evicts on its own and nobody reports
    that, and a block lives in the segment of the engine that wrote it, so it leaves with that
    engine. Hence hints: a block counts as present for `ttl_s` after it was last reported, at
    most `max_blocks` per store (oldest out first), and an engine's blocks are forgotten when it
    restarts. A wrong hint costs one recompute on the engine chosen, never a wrong answer.
    """

    __slots__ = ("_stores", "ttl_s", "max_blocks")

    def __init__(self, ttl_s: float, max_blocks: int) -> None:
        if ttl_s <= 0 or max_blocks < 1:
            raise ValueError(f"ttl_s must be > 0 and max_blocks >= 1, got {ttl_s}, {max_blocks}")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        # store -> block hash -> (when last reported, the url that wrote it); oldest first.
        self._stores: dict[str, OrderedDict[BlockHash, tuple[float, str]]] = {}

    def num_blocks(self, store: str, now: float) -> int:
        """Blocks of `store` still within their age limit."""
        blocks = self._stores.get(store)
        if blocks is None:
            return 0
        self._expire(blocks, now)
        return len(blocks)

    def add(self, store: str, writer: str, hashes: Iterable[BlockHash], now: float) -> None:
        """`writer` (an engine's url) reported `hashes` stored: they are in `store` from now."""
        blocks = self._stores.setdefault(store, OrderedDict())
        for h in hashes:
            blocks[h] = (now, writer)
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
        self._expire(blocks, now)

    def forget_writer(self, writer: str) -> None:
        """Drop the blocks `writer` wrote: its segment, and they with it, left the store. O(store)
        (an engine restarting is rare)."""
        for blocks in self._stores.values():
            for h in [h for h, (_, w) in blocks.items() if w == writer]:
                del blocks[h]

    def match(
        self,
        store: str,
        hashes: Sequence[BlockHash],
        now: float,
        skip_writers: Container[str] = frozenset(),
    ) -> int:
        """How many leading blocks of `hashes` `store` holds, by the hints within their age;
        blocks written by `skip_writers` (engines down now, their segments likely gone) are not."""
        blocks = self._stores.get(store)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            seen = blocks.get(h)
            if seen is None or now - seen[0] > self.ttl_s or seen[1] in skip_writers:
                break
            n += 1
        return n

    def _expire(self, blocks: OrderedDict[BlockHash, tuple[float, str]], now: float) -> None:
        while blocks:
            h, (at, _) = next(iter(blocks.items()))
            if now - at <= self.ttl_s:
                return
            del blocks[h]
