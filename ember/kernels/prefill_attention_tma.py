"""Causal prefill attention with Hopper's tensor memory accelerator: fresh prompts (no cached
prefix) from this step's K and V rows, and chunks over a cached prefix through the paged cache.

The FRESH variant of `prefill_attention` reads this step's Q, K and V rows through pointer tiles
(every address computed by the threads, cp.async); this one builds a TMA descriptor per
sequence and loads whole tiles with one instruction each, which frees the registers and issue
slots the address arithmetic took. With them a 128-query tile fits one warpgroup (4 warps) and
two programs share an SM (96 KB of shared memory each with two stages of 64-key K and V tiles),
so one program's softmax overlaps the other's matmuls. bf16, 32 / 8 heads of 128, causal, H100,
TFLOP/s (`benchmarks/probes/attention_kernels.py`): 8 x 2048 397 against 336 for the pointer kernel,
1 x 16384 516 against 434, 16 x 1024 259 against 223 (cuDNN, built per length: 518 / 598 / 419).

The descriptors end at each sequence's last row: a tile's rows past it load as zeros and its
stores there are dropped, so a tile never writes the next sequence's output. Building them
in the kernel takes a little global scratch memory per program, which Triton asks of the
allocator set in the launching thread (a ContextVar), so every launch sets it.

The paged kernel reads K and V through one descriptor over the layer's cache seen as [blocks,
2 * page rows, Hkv * D]: with pages a whole number of 64-key tiles (a GPU engine's default pages
of 64 tokens) a key tile is one TMA copy from one page, its block looked up once. Pages of 16
would take four copies a tile (Hopper's TMA has no gather), so those stay on the pointer kernel.
Chunks over a cached prefix, bf16, 32 / 8 heads of 128, H100, TFLOP/s: 1 x (32768 + 2048) 531
against 304 for the pointer kernel over pages of 16 and 338 for FlashAttention-2 (unpaged);
8 x (2048 + 512) 395 against 241 and 298 (`benchmarks/probes/attention_kernels.py --extend-only`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.dispatch import LOG2E, capability, dot_precision
from ember.kernels.varlen_tiles import program_tile


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the TMA kernel takes these tensors on this device: a Hopper-or-later GPU, 16-bit
    types, a head dim of 64 or 128, heads contiguous within a row, and rows that start on 16
    bytes (TMA's alignment)."""
    if not q.is_cuda or capability(q)[0] < 9:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128):
        return False
    for t in (q, k, v, out):
        if t.dtype != q.dtype or t.stride(1) != t.shape[2] or t.stride(2) != 1:
            return False
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
    return True


def paged_usable(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the paged TMA kernel takes these tensors: as `usable`, the cache in q's type with
    each page's rows ([block, plane, token] of [num_blocks, 2, block_size, Hkv, D]) evenly strided
    on 16 bytes, and pages a whole number of key tiles (PAGE_BLOCK_N tokens)."""
    if not usable(q, q, q, out) or kv_cache.dtype != q.dtype:
        return False
    _, _, page, heads, dim = kv_cache.shape
    row = heads * dim
    if page % PAGE_BLOCK_N or kv_cache.stride(3) != dim or kv_cache.stride(2) != row:
        return False
    if kv_cache.stride(1) != page * row or kv_cache.data_ptr() % 16:
        return False
    return (kv_cache.stride(0) * kv_cache.element_size()) % 16 == 0


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the descriptors the kernel builds (128 bytes each)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


@triton.jit
def _key_tile(
    acc,
    l_i,
    m_i,
    q,
    k_desc,
    v_desc,
    k_at,
    v_at,
    n0,
    q_pos,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile of the online softmax; MASKED for the tiles on the causal diagonal. `k_at` and
    `v_at` are the tiles' coordinates in their descriptors (a paged tile's are 3-D, [block, row,
    column], and load as [1, BLOCK_N, D])."""
    k = k_desc.load(k_at)
    k = k.reshape([BLOCK_N, q.shape[1]])
    qk = tl.dot(q, k.T, input_precision=DOT_PRECISION)
    if MASKED:
        pos = n0 + tl.arange(0, BLOCK_N)
        qk = tl.where(pos[None, :] <= q_pos[:, None], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_new[:, None]
    else:  # the scale folded into one multiply-add per score
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_new[:, None]
    p = tl.exp2(qk)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load(v_at)
    v = v.reshape([BLOCK_N, q.shape[1]])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# query_start_loc is sliced past a step's decode rows (any offset): its alignment does not
# specialize, so a fresh prompt after 1 or 16 decode rows takes the same variant.
@triton.jit(do_not_specialize=["num_seqs"], do_not_specialize_on_alignment=["query_start_loc_ptr"])
def _fresh_tma_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    query_start_loc_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in exp2
    num_seqs,
    stride_qt,
    stride_kt,
    stride_vt,
    stride_ot,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # As prefill_attention's: heads fastest, tiles last to first.
    head, seq, q_start, q_len, m0 = program_tile(query_start_loc_ptr, num_seqs, NUM_HEADS, BLOCK_M)
    end = q_start + q_len
    if (m0 < 0) | (m0 >= q_len):  # before the first sequence's rows, or a spare tile
        return
    q_desc = tl.make_tensor_descriptor(
        q_ptr, [end, NUM_HEADS * HEAD_DIM], [stride_qt, 1], [BLOCK_M, HEAD_DIM]
    )
    o_desc = tl.make_tensor_descriptor(
        out_ptr, [end, NUM_HEADS * HEAD_DIM], [stride_ot, 1], [BLOCK_M, HEAD_DIM]
    )
    k_desc = tl.make_tensor_descriptor(
        k_ptr, [end, NUM_KV_HEADS * HEAD_DIM], [stride_kt, 1], [BLOCK_N, HEAD_DIM]
    )
    v_desc = tl.make_tensor_descriptor(
        v_ptr, [end, NUM_KV_HEADS * HEAD_DIM], [stride_vt, 1], [BLOCK_N, HEAD_DIM]
    )
    q = q_desc.load([q_start + m0, head * HEAD_DIM])
    q_pos = m0 + tl.arange(0, BLOCK_M)
    col = head // (NUM_HEADS // NUM_KV_HEADS) * HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Keys before full_end are visible to every row of the tile: no mask.
    full_end = (m0 + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _key_tile(
            acc, l_i, m_i, q, k_desc, v_desc, (q_start + n0, col), (q_start + n0, col), n0,
            q_pos, qk_scale, BLOCK_N, False, DOT_PRECISION,
        )  # fmt: skip
    # Key 0 is in the first tile visited and visible to every row, so no row is all -inf.
    for n0 in range(full_end, tl.minimum(q_len, m0 + BLOCK_M), BLOCK_N):
        acc, l_i, m_i = _key_tile(
            acc, l_i, m_i, q, k_desc, v_desc, (q_start + n0, col), (q_start + n0, col), n0,
            q_pos, qk_scale, BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip
    o_desc.store([q_start + m0, head * HEAD_DIM], (acc / l_i[:, None]).to(out_ptr.dtype.element_ty))


# As the pointer kernel: batch-dependent sizes and the metadata's sliced pointers do not specialize.
@triton.jit(
    do_not_specialize=["num_seqs", "num_blocks", "stride_bt", "stride_cache_block"],
    do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"],
)
def _paged_tma_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in exp2
    num_seqs,
    num_blocks,
    stride_qt,
    stride_ot,
    stride_bt,
    stride_cache_block,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # As the fresh kernel, but each sequence's keys are its whole context in the paged cache: a
    # key tile lies in one page (PAGE_SIZE a multiple of BLOCK_N), one TMA load for K and one for V
    # from a descriptor over the layer's cache seen as [blocks, 2 * PAGE_SIZE rows, Hkv * D].
    head, seq, q_start, q_len, m0 = program_tile(query_start_loc_ptr, num_seqs, NUM_HEADS, BLOCK_M)
    if (m0 < 0) | (m0 >= q_len):  # before the first sequence's rows, or a spare tile
        return
    end = q_start + q_len
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first_pos = seq_len - q_len  # the position of the sequence's first new query
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    q_desc = tl.make_tensor_descriptor(
        q_ptr, [end, NUM_HEADS * HEAD_DIM], [stride_qt, 1], [BLOCK_M, HEAD_DIM]
    )
    o_desc = tl.make_tensor_descriptor(
        out_ptr, [end, NUM_HEADS * HEAD_DIM], [stride_ot, 1], [BLOCK_M, HEAD_DIM]
    )
    ROW: tl.constexpr = NUM_KV_HEADS * HEAD_DIM  # a token's row of one plane
    kv_desc = tl.make_tensor_descriptor(
        kv_ptr,
        [num_blocks, 2 * PAGE_SIZE, ROW],
        [stride_cache_block, ROW, 1],
        [1, BLOCK_N, HEAD_DIM],
    )
    q = q_desc.load([q_start + m0, head * HEAD_DIM])
    q_pos = first_pos + m0 + tl.arange(0, BLOCK_M)
    col = head // (NUM_HEADS // NUM_KV_HEADS) * HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Keys before full_end are visible to every row of the tile (the cached prefix and the tile's
    # own earlier rows): no mask, and all of them inside the context.
    full_end = (first_pos + m0 + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        block = tl.load(table + n0 // PAGE_SIZE).to(tl.int32)
        row = n0 % PAGE_SIZE
        acc, l_i, m_i = _key_tile(
            acc, l_i, m_i, q, kv_desc, kv_desc, (block, row, col), (block, PAGE_SIZE + row, col),
            n0, q_pos, qk_scale, BLOCK_N, False, DOT_PRECISION,
        )  # fmt: skip
    # The diagonal tiles, masked. Key 0 is in the first tile visited and visible to every row.
    diag_end = tl.minimum(seq_len, first_pos + m0 + BLOCK_M)
    tail = seq_len // BLOCK_N * BLOCK_N  # >= full_end
    for n0 in range(full_end, tl.minimum(tail, diag_end), BLOCK_N):
        block = tl.load(table + n0 // PAGE_SIZE).to(tl.int32)
        row = n0 % PAGE_SIZE
        acc, l_i, m_i = _key_tile(
            acc, l_i, m_i, q, kv_desc, kv_desc, (block, row, col), (block, PAGE_SIZE + row, col),
            n0, q_pos, qk_scale, BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip
    if tail < diag_end:
        # The context's last, partial tile: its page's slots past the context hold whatever they
        # held. Their scores are masked, but a zero weight times a NaN there would still be NaN,
        # so V comes through a descriptor of the page's rows that ends at the context's last
        # (past it, TMA loads zeros) rather than through a `where` on the tile, which spilled.
        page_start = tail // PAGE_SIZE * PAGE_SIZE
        block = tl.load(table + tail // PAGE_SIZE)
        v_page = kv_ptr + block.to(tl.int64) * stride_cache_block + PAGE_SIZE * ROW
        v_desc = tl.make_tensor_descriptor(
            v_page, [seq_len - page_start, ROW], [ROW, 1], [BLOCK_N, HEAD_DIM]
        )
        row = tail - page_start
        acc, l_i, m_i = _key_tile(
            acc, l_i, m_i, q, kv_desc, v_desc, (block.to(tl.int32), row, col), (row, col),
            tail, q_pos, qk_scale, BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip
    o_desc.store([q_start + m0, head * HEAD_DIM], (acc / l_i[:, None]).to(out_ptr.dtype.element_ty))


PAGE_BLOCK_N = 64
"""Keys a tile, in both kernels: the paged kernel needs pages of a multiple of this many tokens."""


def tile_config(max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): one warpgroup, two programs an SM (above)."""
    return (64 if max_query_len <= 64 else 128), PAGE_BLOCK_N, 4, 2


def _launch(
    kernel: triton.JITFunction,
    q: torch.Tensor,
    num_kv_heads: int,
    num_seqs: int,
    max_query_len: int,
    *args: object,
    **constexprs: object,
) -> None:
    """Launch one of the kernels above over q [T, Hq, D]: a program per (query tile, head), with
    the tiles, warps and constexprs both take; `args` and `constexprs` are the kernel's own."""
    num_tokens, num_heads, head_dim = q.shape
    block_m, block_n, num_warps, num_stages = tile_config(max_query_len)
    triton.set_allocator(_scratch)
    kernel[((num_tokens // block_m + num_seqs) * num_heads,)](
        *args,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        **constexprs,
    )


def fresh_attention_tma(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """Causal attention of fresh sequences, q [T, Hq, D] and k, v [T, Hkv, D] (sequence i's rows
    query_start_loc[i]:query_start_loc[i+1]), into out; prefill_attention has checked the
    shapes and `usable` the layout. Rows outside the sequences are neither read nor written."""
    num_seqs = query_start_loc.shape[0] - 1
    _launch(
        _fresh_tma_kernel, q, k.shape[1], num_seqs, max_query_len,
        q, k, v, out, query_start_loc, scale * LOG2E, num_seqs,
        q.stride(0), k.stride(0), v.stride(0), out.stride(0),
    )  # fmt: skip
    return out


def paged_attention_tma(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole context in the paged cache
    (one layer's [num_blocks, 2, block_size, Hkv, D], this step's K and V already written), into
    out; prefill_attention has checked the shapes and `paged_usable` the layout."""
    num_blocks, _, page, num_kv_heads, _ = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    _launch(
        _paged_tma_kernel, q, num_kv_heads, num_seqs, max_query_len,
        q, kv_cache, out, query_start_loc, seq_lens, block_tables, scale * LOG2E, num_seqs,
        num_blocks, q.stride(0), out.stride(0), block_tables.stride(0), kv_cache.stride(0),
        PAGE_SIZE=page,
    )  # fmt: skip
    return out
