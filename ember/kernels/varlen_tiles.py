"""Which sequence a query tile belongs to, in the varlen prefill kernels' flat grid of tiles."""

from __future__ import annotations

import triton
import triton.language as tl


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


@triton.jit
def program_tile(query_start_loc_ptr, num_seqs, NUM_HEADS: tl.constexpr, BLOCK_M: tl.constexpr):
    """(head, sequence, its first row, its row count, the tile's first row within it) of this
    program. Heads vary fastest, so the heads of one KV group run together and share K/V through
    L2; tiles go last to first: under the causal mask a sequence's later tiles see more keys, and
    starting the longest work first shortens the tail of the launch. Offsets come back as int32
    whatever query_start_loc's type (a TMA descriptor's shape takes 32-bit sizes). The tile's
    first row is < 0 or >= the row count for a program with no rows (a tile before the first
    sequence's, when query_start_loc[0] > 0, or a sequence's spare tile): it must return."""
    pid = tl.program_id(0)
    head = pid % NUM_HEADS
    tile = tl.num_programs(0) // NUM_HEADS - 1 - pid // NUM_HEADS
    seq = find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    m0 = (tile - (q_start // BLOCK_M + seq)) * BLOCK_M
    return head, seq, q_start, q_len, m0
