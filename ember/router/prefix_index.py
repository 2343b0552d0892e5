"""The router's index of which endpoint holds which KV blocks, fed by the engines' KV events.

Keys are chained block hashes (`ember.kv.block_hash`): block i's hash covers the whole prefix up to
block i, so matching a prompt is a walk over its hashes until the first block nobody holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.kv.block_hash import BlockHash


class PrefixIndex:
    """Block hash -> urls holding it, and url -> its hashes (so `forget` is O(its blocks))."""

    __slots__ = ("_holders", "_blocks")

    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[str]] = {}
        self._blocks: dict[str, set[BlockHash]] = {}

    def __len__(self) -> int:
        """Distinct blocks held anywhere."""
        return len(self._holders)

    def num_blocks(self, url: str) -> int:
        return len(self._blocks.get(url, ()))

    def apply(self, url: str, stored: Iterable[BlockHash], removed: Iterable[BlockHash]) -> None:
        """One batch of `url`'s KV events. A hash in both lists ends removed: a false hit would
        draw requests to an endpoint that must recompute, a false miss only costs one reuse."""
        blocks = self._blocks.setdefault(url, set())
        for h in stored:
            if h not in blocks:
                blocks.add(h)
                self._holders.setdefault(h, set()).add(url)
        for h in removed:
            self._drop(url, h, blocks)
        if not blocks:
            del self._blocks[url]

    def forget(self, url: str) -> None:
        """Drop everything `url` held: it died, restarted, or cleared its cache."""
        blocks = self._blocks.pop(url, set())
        for h in list(blocks):
            self._drop(url, h, blocks)

    def _drop(self, url: str, h: BlockHash, blocks: set[BlockHash]) -> None:
        if h not in blocks:
            return  # an eviction we never saw stored (events lost or replayed): nothing to undo
        blocks.discard(h)
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
