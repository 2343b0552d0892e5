"""NH sums of KV blocks, the universal hash under their keyed transfer tags (Triton, with the NumPy
reference beside it). ember/kv/transport/block_tags.py turns them into tags.

A block is read as W 32-bit words m and hashed with key words k (W + 2 of them) in two lanes:
    NH_l = sum_i ((m[2i] + k[2i + 2l]) mod 2^32) * ((m[2i + 1] + k[2i + 1 + 2l]) mod 2^32) mod 2^64
(UMAC's NH, 2^-32-almost-delta-universal per lane; the lanes' keys are offset by two words, as
UMAC's Toeplitz construction). Bytes: the kernel reads each block once, and each key word once a
block; it computes one 64-bit multiply-add per word pair and lane. Each program sums one chunk of
one block; the chunks' partial sums (a few hundred bytes a block) are added on the host, where
NumPy's uint64 wraps as defined.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

CHUNK_PAIRS = 2048
"""Word pairs one program sums (16 KiB of a block)."""


@triton.jit
def _nh_kernel(
    data_ptr,  # int32 words: the cache viewed as [num_blocks, words_per_block]
    key_ptr,  # int32 words: words_per_block + 2
    ids_ptr,  # int64 block ids
    out_ptr,  # int64: [len(ids), num_chunks, 2]
    words_per_block,
    num_chunks,
    CHUNK: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    block = tl.load(ids_ptr + b).to(tl.int64)
    pair = c * CHUNK + tl.arange(0, CHUNK)
    mask = pair < words_per_block // 2
    row = data_ptr + block * words_per_block
    m0 = tl.load(row + 2 * pair, mask=mask, other=0).to(tl.uint32, bitcast=True)
    m1 = tl.load(row + 2 * pair + 1, mask=mask, other=0).to(tl.uint32, bitcast=True)
    out = out_ptr + (b.to(tl.int64) * num_chunks + c) * 2
    for lane in tl.static_range(2):
        # Masked pairs load key words as 0 too: (0 + 0) * (0 + 0) adds nothing.
        k0 = tl.load(key_ptr + 2 * pair + 2 * lane, mask=mask, other=0).to(tl.uint32, bitcast=True)
        k1 = tl.load(key_ptr + 2 * pair + 1 + 2 * lane, mask=mask, other=0).to(
            tl.uint32, bitcast=True
        )
        prod = (m0 + k0).to(tl.uint64) * (m1 + k1).to(tl.uint64)
        tl.store(out + lane, tl.sum(prod, axis=0).to(tl.int64, bitcast=True))


def nh_sums(words: torch.Tensor, key: torch.Tensor, block_ids: torch.Tensor) -> np.ndarray:
    """NH_0 and NH_1 of the listed blocks, as a uint64 array [len(block_ids), 2].

    `words`: the cache as int32 [num_blocks, W] (W even, contiguous); `key`: int32 [W + 2] on the
    same device; `block_ids`: int64 on that device."""
    n, words_per_block = len(block_ids), words.shape[1]
    if words_per_block % 2 or key.numel() < words_per_block + 2:
        raise ValueError(f"{words_per_block} words a block need an even count and W + 2 key words")
    chunks = triton.cdiv(words_per_block // 2, CHUNK_PAIRS)
    partial = torch.empty((n, chunks, 2), dtype=torch.int64, device=words.device)
    if n:
        _nh_kernel[(n, chunks)](
            words, key, block_ids, partial, words_per_block, chunks, CHUNK=CHUNK_PAIRS
        )
    return partial.cpu().numpy().view(np.uint64).sum(axis=1, dtype=np.uint64)


def nh_sums_reference(words: np.ndarray, key: np.ndarray) -> np.ndarray:
    """The same sums in NumPy: `words` uint32 [n, W], `key` uint32 [W + 2] -> uint64 [n, 2]."""
    n, w = words.shape
    out = np.empty((n, 2), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for lane in range(2):
            a = (words[:, 0::2] + key[2 * lane : 2 * lane + w : 2]).astype(np.uint64)
            b = (words[:, 1::2] + key[2 * lane + 1 : 2 * lane + 1 + w : 2]).astype(np.uint64)
            out[:, lane] = (a * b).sum(axis=1, dtype=np.uint64)
    return out
