"""Keyed tags on KV blocks that cross a network: the prefill engine tags each block it leases, the
decode engine recomputes the tags over what it read and uses the blocks only if they all match.
A block written into either engine's memory by anyone without the cluster secret (Mooncake has no
access control) is then refused and the prompt recomputed, never served.

The tag of block i of a lease is NH(block) + PRF(lease, i) mod 2^64 in each of two lanes: NH, a
universal hash under a key stream drawn from the cluster secret (ember/kernels/kv_tag.py: a Triton
kernel on GPUs, NumPy on the CPU), masked by 16 bytes of a SHAKE-256 stream keyed by the secret and
the lease id, at the block's place in the lease (a Wegman-Carter MAC: a tag reveals nothing of the
key, and no two blocks share a mask). The tags travel inside the lease's signed parameters."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

TAG_BYTES = 16


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
        root = hmac.new(secret.encode(), b"ember KV block tags", hashlib.sha256).digest()
        self._mask_key = hmac.new(root, b"mask", hashlib.sha256).digest()
        stream = hashlib.shake_256(root + b"nh").digest(4 * (self.words_per_block + 2))
        self._key = np.frombuffer(stream, dtype=np.uint32).copy()
        self._words = kv_cache.view(self.num_blocks, -1).view(torch.int32)
        self._cuda = kv_cache.is_cuda
        self._key_dev = torch.from_numpy(self._key.view(np.int32)).to(kv_cache.device)

    def tags(self, block_ids: Sequence[int], lease_id: str, first: int = 0) -> list[str]:
        """Hex tags of `block_ids`, the lease's blocks from its `first` on (on a GPU, after the
        work queued on the cache's stream: the caller's writes are ordered before it)."""
        sums = self._nh(block_ids)
        masks = np.frombuffer(self._masks(lease_id, first, len(block_ids)), dtype=np.uint64)
        masks = masks.reshape(-1, 2)
        with np.errstate(over="ignore"):
            tagged = sums + masks
        return [row.tobytes().hex() for row in tagged]

    def verify(
        self, block_ids: Sequence[int], lease_id: str, expected: Sequence[str], first: int = 0
    ) -> bool:
        """Whether the listed blocks hold what the lease's tags (from its `first` on) say."""
        if len(expected) != len(block_ids):
            return False
        got = self.tags(block_ids, lease_id, first)
        return all(hmac.compare_digest(a, b) for a, b in zip(got, expected, strict=True))

    def _masks(self, lease_id: str, first: int, n: int) -> bytes:
        """The masks of blocks first .. first + n - 1 of a lease: one keyed SHAKE-256 stream a
        lease (a PRF: SHA-3's sponge has no length extension), TAG_BYTES a block."""
        stream = hashlib.shake_256(self._mask_key + lease_id.encode())
        return stream.digest(TAG_BYTES * (first + n))[TAG_BYTES * first :]

    def _nh(self, block_ids: Sequence[int]) -> np.ndarray:
        import torch

        from ember.kernels.kv_tag import nh_sums, nh_sums_reference

        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError("a block id outside the KV cache")
        if not block_ids:
            return np.empty((0, 2), dtype=np.uint64)
        if self._cuda:
            ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self._words.device)
            return nh_sums(self._words, self._key_dev, ids)
        words = self._words.numpy().view(np.uint32)
        return nh_sums_reference(words[list(block_ids)], self._key)
