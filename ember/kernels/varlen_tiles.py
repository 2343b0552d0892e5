"""Which sequence a query tile belongs to, in the varlen prefill kernels' flat grid of tiles."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
"""The attention kernels work in exp2: the softmax scale is multiplied by log2(e)."""


@triton.jit
def find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_M: tl.constexpr):
    # Sequence i owns tiles [qsl[i] // BLOCK_M + i, qsl[i+1] // BLOCK_M + i + 1): at least
    # cdiv(q_len, BLOCK_M) of them, and strictly increasing starts, so binary search works with
    # no host-side prefix sum.
    lo: tl.int32 = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo
