"""Keyed tags on KV blocks that cross a network: the prefill engine tags each block it leases, the
decode engine recomputes the tags over what it read and uses the blocks only if they all match.
A block written into either engine's memory by anyone without the cluster secret (Mooncake has no
access control) is then refused and the prompt recomputed, never served.

Two schemes, named in each tag ("nh:..." or "b2:..."), both keyed by the cluster secret and bound
to the lease and the block's place in it:
- "nh", for a cache on a GPU: NH(block) + PRF(lease, i) mod 2^64 in each of two lanes. NH is a
  universal hash under a key stream drawn from the secret (ember/kernels/kv_tag.py, a Triton
  kernel that reads the block once), masked by 16 bytes of a SHAKE-256 stream keyed by the secret
  and the lease id (a Wegman-Carter MAC: a tag reveals nothing of the key, no two blocks share a
  mask).
- "b2", for a cache in host memory: BLAKE2b-128 keyed by the secret over the lease, the index and
  the block, on threads (hashlib lets go of the GIL): 3-4x NH's speed in NumPy.
The receiver computes the scheme the sender named. The tags travel inside the lease's signed
parameters."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

TAG_BYTES = 16


def rank_lease(lease_id: str, rank: int, size: int) -> str:
    """What rank `rank` of a prefill engine of `size` ranks keys its share's tags by: each rank
    its own, so that one rank's bytes cannot pass for another's."""
    return lease_id if size == 1 else f"{lease_id}#rank{rank}"


class BlockTagger:
    """Tags of one KV cache's blocks (`block_bytes` each, a multiple of 8) under `secret`."""

    def __init__(self, secret: str, kv_cache: torch.Tensor) -> None:
        import torch

        if not secret:
            raise ValueError("KV block tags need the cluster secret")
        self.num_blocks = kv_cache.shape[0]
        block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        if block_bytes % 8:
            raise ValueError(f"a KV block of {block_bytes} bytes cannot be tagged (not 8k bytes)")
        self.words_per_block = block_bytes // 4
        self._root = hmac.new(secret.encode(), b"ember KV block tags", hashlib.sha256).digest()
        self._mask_key = hmac.new(self._root, b"mask", hashlib.sha256).digest()
        self._b2_key = hmac.new(self._root, b"blake2b", hashlib.sha256).digest()
        self._words = kv_cache.view(self.num_blocks, -1).view(torch.int32)
        self._cuda = kv_cache.is_cuda
        self.scheme = "nh" if self._cuda else "b2"
        self._pool: ThreadPoolExecutor | None = None

    def tags(
        self, block_ids: Sequence[int], lease_id: str, first: int = 0, scheme: str | None = None
    ) -> list[str]:
        """Tags of `block_ids`, the lease's blocks from its `first` on, in this cache's scheme
        (or `scheme`); on a GPU, after the work queued on the cache's stream: the caller's
        writes are ordered before it."""
        scheme = scheme or self.scheme
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError("a block id outside the KV cache")
        if scheme == "b2":
            return [f"b2:{t}" for t in self._b2(block_ids, lease_id, first)]
        if scheme != "nh":
            raise ValueError(f"unknown KV tag scheme {scheme!r}")
        sums = self._nh(block_ids)
        masks = np.frombuffer(self._masks(lease_id, first, len(block_ids)), dtype=np.uint64)
        masks = masks.reshape(-1, 2)
        with np.errstate(over="ignore"):
            tagged = sums + masks
        return [f"nh:{row.tobytes().hex()}" for row in tagged]

    def verify(
        self, block_ids: Sequence[int], lease_id: str, expected: Sequence[str], first: int = 0
    ) -> bool:
        """Whether the listed blocks hold what the lease's tags (from its `first` on) say, in
        the scheme the sender named."""
        if len(expected) != len(block_ids):
            return False
        if not block_ids:
            return True
        scheme = expected[0].partition(":")[0]
        if scheme not in ("nh", "b2"):
            return False
        got = self.tags(block_ids, lease_id, first, scheme)
        return all(hmac.compare_digest(a, b) for a, b in zip(got, expected, strict=True))

    @cached_property
    def _key(self) -> np.ndarray:
        """NH's key stream (W + 2 words, drawn from the secret): made when "nh" is first used."""
        stream = hashlib.shake_256(self._root + b"nh").digest(4 * (self.words_per_block + 2))
        return np.frombuffer(stream, dtype=np.uint32).copy()

    @cached_property
    def _key_dev(self) -> torch.Tensor:
        import torch

        return torch.from_numpy(self._key.view(np.int32)).to(self._words.device)

    def _b2(self, block_ids: Sequence[int], lease_id: str, first: int) -> list[str]:
        rows = self._words[list(block_ids)].cpu() if self._cuda else None
        prefix = lease_id.encode() + b"\0"

        def one(i: int) -> str:
            row = rows[i] if rows is not None else self._words[block_ids[i]]
            h = hashlib.blake2b(
                prefix + (first + i).to_bytes(8, "little"), key=self._b2_key, digest_size=TAG_BYTES
            )
            h.update(memoryview(row.numpy()).cast("B"))
            return h.hexdigest()

        if len(block_ids) < 4:
            return [one(i) for i in range(len(block_ids))]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), "ember-kv-tags")
        return list(self._pool.map(one, range(len(block_ids))))

    def _masks(self, lease_id: str, first: int, n: int) -> bytes:
        """The masks of blocks first .. first + n - 1 of a lease: one keyed SHAKE-256 stream a
        lease (a PRF: SHA-3's sponge has no length extension), TAG_BYTES a block."""
        stream = hashlib.shake_256(self._mask_key + lease_id.encode())
        return stream.digest(TAG_BYTES * (first + n))[TAG_BYTES * first :]

    def _nh(self, block_ids: Sequence[int]) -> np.ndarray:
        import torch

        from ember.kernels.kv_tag import nh_sums, nh_sums_reference

        if not block_ids:
            return np.empty((0, 2), dtype=np.uint64)
        if self._cuda:
            ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self._words.device)
            return nh_sums(self._words, self._key_dev, ids)
        words = self._words.numpy().view(np.uint32)
        return nh_sums_reference(words[list(block_ids)], self._key)
