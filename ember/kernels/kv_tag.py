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

CHUNK_PAIRS = 1024
"""Word pairs one step of a program sums (8 KiB of a block: each thread loads whole pairs)."""
STEPS = 32
"""Steps of one program: 256 KiB of a block, so a 2 MiB block leaves 8 partial sums (a lease too
small to fill the GPU that way takes SMALL_STEPS)."""
SMALL_STEPS = 8
NUM_WARPS = 16
"""The tiling measured fastest on an H200 (benchmarks/kv_tag_cost.py --sweep, 1024 blocks of the
8B shape: 2.5 TB/s against 2.4 for the next ones; docs/performance.md)."""


@triton.jit
def _nh_kernel(
    data_ptr,  # int64 word pairs: the cache viewed as [num_blocks, pairs_per_block]
    key_ptr,  # int64 key word pairs: pairs_per_block + 1
    ids_ptr,  # int64 block ids
    out_ptr,  # int64: [len(ids), num_chunks, 2]
    pairs_per_block,
    num_chunks,
    CHUNK: tl.constexpr,
    STEPS: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    block = tl.load(ids_ptr + b).to(tl.int64)
    row = data_ptr + block * pairs_per_block
    acc0 = tl.zeros([CHUNK], dtype=tl.uint64)
    acc1 = tl.zeros([CHUNK], dtype=tl.uint64)
    for s in range(STEPS):
        pair = (c * STEPS + s).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        mask = pair < pairs_per_block
        # One 8-byte load a pair (little-endian: word 2i low, word 2i + 1 high); masked pairs
        # load 0 for data and key alike, and (0 + 0) * (0 + 0) adds nothing.
        m = tl.load(row + pair, mask=mask, other=0).to(tl.uint64, bitcast=True)
        lane0 = tl.load(key_ptr + pair, mask=mask, other=0).to(tl.uint64, bitcast=True)
        lane1 = tl.load(key_ptr + pair + 1, mask=mask, other=0).to(tl.uint64, bitcast=True)
        lo = m.to(tl.uint32)
        hi = (m >> 32).to(tl.uint32)
        # 32-bit adds wrap mod 2^32; their product widens to 64 bits exactly; sums wrap mod 2^64.
        acc0 += (lo + lane0.to(tl.uint32)).to(tl.uint64) * (hi + (lane0 >> 32).to(tl.uint32)).to(
            tl.uint64
        )
        acc1 += (lo + lane1.to(tl.uint32)).to(tl.uint64) * (hi + (lane1 >> 32).to(tl.uint32)).to(
            tl.uint64
        )
    out = out_ptr + (b.to(tl.int64) * num_chunks + c) * 2
    tl.store(out, tl.sum(acc0, axis=0).to(tl.int64, bitcast=True))
    tl.store(out + 1, tl.sum(acc1, axis=0).to(tl.int64, bitcast=True))


def nh_sums(
    words: torch.Tensor,
    key: torch.Tensor,
    block_ids: torch.Tensor,
    chunk: int = CHUNK_PAIRS,
    steps: int | None = None,
    num_warps: int = NUM_WARPS,
) -> np.ndarray:
    """NH_0 and NH_1 of the listed blocks, as a uint64 array [len(block_ids), 2].

    `words`: the cache as int32 [num_blocks, W] (W even, contiguous); `key`: int32 [W + 2] on the
    same device; `block_ids`: int64 on that device. `chunk`, `steps`, `num_warps`: the tiling
    (benchmarks/kv_tag_cost.py --sweep measures others)."""
    n, words_per_block = len(block_ids), words.shape[1]
    if words_per_block % 2 or key.numel() < words_per_block + 2:
        raise ValueError(f"{words_per_block} words a block need an even count and W + 2 key words")
    pairs = words_per_block // 2
    if steps is None:
        programs = n * triton.cdiv(pairs, chunk * STEPS)
        steps = STEPS if words.is_cuda and programs >= 4 * _sms(words.device) else SMALL_STEPS
    chunks = triton.cdiv(pairs, chunk * steps)
    partial = torch.empty((n, chunks, 2), dtype=torch.int64, device=words.device)
    if n:
        _nh_kernel[(n, chunks)](
            words.view(torch.int64),
            key[: words_per_block + 2].view(torch.int64),
            block_ids,
            partial,
            pairs,
            chunks,
            CHUNK=chunk,
            STEPS=steps,
            num_warps=num_warps,
        )
    return partial.cpu().numpy().view(np.uint64).sum(axis=1, dtype=np.uint64)


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


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
