"""Chained block hashes for prefix caching: h_i = SHA-256(h_{i-1} || tokens of block i || extra keys).

The digest is the full 32 bytes and depends only on its inputs, so it is identical across processes
and nodes; the router's prefix index, KV events and the lower storage tiers key on the same values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

BlockHash = bytes


def root_hash(namespace: str) -> BlockHash:
    """The parent of a sequence's first block: namespaces hashes by model, dtype and KV layout."""
    return hashlib.sha256(b"ember-kv-v1\x00" + namespace.encode()).digest()


def hash_block_tokens(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple[object, ...] | None = None
) -> BlockHash:
    """Hash one full block given its parent's hash; `extra_keys` (e.g. a cache salt) must be JSON-able."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    if extra_keys:
        h.update(b"\x00" + json.dumps(extra_keys, separators=(",", ":")).encode())
    return h.digest()


def hash_blocks(
    parent: BlockHash,
    token_ids: Sequence[int],
    block_size: int,
    start_block: int = 0,
    first_extra_keys: tuple[object, ...] | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from `start_block` on, chained from `parent`.

    `parent` is the hash of block `start_block - 1` (or the root for block 0); extra keys apply to
    block 0 only, which is enough to separate whole chains.
    """
    out: list[BlockHash] = []
    for i in range(start_block, len(token_ids) // block_size):
        extra = first_extra_keys if i == 0 else None
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out
