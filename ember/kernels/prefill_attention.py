"""Paged varlen attention for prefill, chunked prefill and extend (Triton, flash-attention style).

Each sequence's new queries (the last q_len of its seq_lens tokens) attend causally to its whole
context, cached prefix and new tokens alike, read through its block table: write_kv has already
put this step's K and V in the cache. One program per (query tile, query head), over the tiles
of every sequence in the flat batch; GQA maps query head h to KV head h // (Hq / Hkv).

The two numbers, per sequence of q_len queries over L keys (causal, L - q_len cached):
flops ~= 4 * Hq * D * q_len * (L - q_len / 2); bytes = q and out (2 * q_len * Hq * D * itemsize)
plus K and V (2 * L * Hkv * D * itemsize) once per query tile and head (mostly L2 hits between
the heads of one KV group). For q_len in the hundreds this is compute-bound on the tensor cores;
at q_len 1 it degenerates to decode, memory-bound, without decode's GQA packing.

Fresh sequences (no cached prefix: every key is one of this step's new tokens) can skip the
cache: given this step's `k` and `v`, the kernel reads their rows at the queries' own offsets,
contiguous and with no block table (FRESH). That is what torch's SDPA did for them before, one
call per sequence; but its cuDNN kernel is built per sequence length at run time: 43-55 ms for
each length not seen before (an H200), on the request path of every new prompt length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels import prefill_attention_tma
from ember.kernels.dispatch import LOG2E, dot_precision
from ember.kernels.varlen_tiles import program_tile


def _tile_config(
    head_dim: int, max_query_len: int, fresh: bool = False
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for H100/H200."""
    # Short query runs (extend, spec decode, q_len-1 rows) waste less in a smaller tile.
    block_m = min(128, max(16, triton.next_power_of_2(max(max_query_len, 1))))
    if head_dim > 128:
        block_m = min(block_m, 64)  # a 128 x 256 fp32 accumulator would spill
    # 128 x 128 fp32 accumulator over 8 warps is 64 registers a thread; K and V tiles of
    # 64 x 128 bf16 are 16 KB each, so 3 stages fit shared memory with room for q.
    num_warps = 8 if block_m == 128 and head_dim >= 128 else 4
    if fresh and block_m == 128 and head_dim <= 128:
        # Contiguous K and V rows take a 128-key tile (two 32 KB tiles a stage, two stages):
        # 8 x 2048 causal on an H200, 328 TFLOP/s against 313 with the paged tiles.
        return block_m, 128, num_warps, 2
    return block_m, 64, num_warps, 3


# Sizes that change from batch to batch (and pointers into sliced tensors) do not specialize:
# one compiled variant serves every batch, so none is compiled on the request path.
@triton.jit(
    do_not_specialize=["num_seqs", "stride_bt"],
    do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"],
)
def _prefill_kernel(
    q_ptr,
    kv_ptr,
    k_ptr,  # FRESH: this step's K and V rows [T, Hkv, D] (kv_ptr and the table unused)
    v_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in exp2
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_tok,
    stride_cache_head,
    stride_bt,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FRESH: tl.constexpr,
):
    head, seq, q_start, q_len, m0 = program_tile(query_start_loc_ptr, num_seqs, NUM_HEADS, BLOCK_M)
    # m0 < 0: a tile before the first sequence's, when query_start_loc[0] > 0 (decode rows at
    # the front of q are another kernel's); m0 >= q_len: a sequence's spare tile.
    if (m0 < 0) | (m0 >= q_len):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # position of the sequence's first new query

    rows = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    row_mask = rows < q_len
    d_mask = d < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = first_pos + rows

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_base = kv_ptr + (head // GROUP) * stride_cache_head
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + (head // GROUP) * stride_kh
    v_base = v_ptr + (head // GROUP) * stride_vh

    # Keys before full_end are visible to every row of the tile: no causal or bounds mask.
    full_end = (first_pos + m0 + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        if FRESH:
            krows = (q_start + pos).to(tl.int64)
            k = tl.load(k_base + krows[:, None] * stride_kt + d[None, :], mask=d_mask[None, :])
            v = tl.load(v_base + krows[:, None] * stride_vt + d[None, :], mask=d_mask[None, :])
        else:
            block = tl.load(table + pos // PAGE_SIZE).to(tl.int64)
            ptrs = (
                kv_base
                + (block * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_tok)[:, None]
            )
            k = tl.load(ptrs + d[None, :], mask=d_mask[None, :], other=0.0)
            v = tl.load(ptrs + stride_cache_kv + d[None, :], mask=d_mask[None, :], other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # The diagonal tiles; tiles wholly past the tile's last query are never visited.
    kv_end = tl.minimum(seq_len, first_pos + m0 + BLOCK_M)
    for n0 in range(full_end, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < kv_end
        mask = n_mask[:, None] & d_mask[None, :]
        if FRESH:
            krows = (q_start + pos).to(tl.int64)
            k = tl.load(k_base + krows[:, None] * stride_kt + d[None, :], mask=mask, other=0.0)
            v = tl.load(v_base + krows[:, None] * stride_vt + d[None, :], mask=mask, other=0.0)
        else:
            block = tl.load(table + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            ptrs = (
                kv_base
                + (block * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_tok)[:, None]
            )
            k = tl.load(ptrs + d[None, :], mask=mask, other=0.0)
            v = tl.load(ptrs + stride_cache_kv + d[None, :], mask=mask, other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        # Key 0 is in the first tile visited and visible to every row, so no row is all -inf
        # by the time it gets here, and alpha is never NaN.
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    tma: bool | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context.

    With `k` and `v` (this step's K and V, [T, Hkv, D] like q) every sequence must be fresh
    (seq_lens[i] == its query count: no cached prefix, which the caller checks): its keys are
    read from their rows, at the queries' offsets, not through the cache (block_tables unused).
    They go through the TMA kernel (ember/kernels/prefill_attention_tma.py) where it runs (a
    Hopper GPU; `tma` True or False forces one kernel or the other, as tests do). So do chunks
    over a cached prefix when the cache's pages are a whole number of key tiles (64 tokens, a
    GPU engine's default); `tma=True` with smaller pages is a ValueError.

    q: [T, Hq, D], sequence i's rows query_start_loc[i]:query_start_loc[i+1] ([B + 1]); kv_cache:
    one layer's view [num_blocks, 2, block_size, Hkv, D] already holding this step's K and V;
    seq_lens: [B] context lengths including the new tokens; block_tables: [B, W]. max_query_len
    (a host-side int) only picks the tile size. Returns out ([T, Hq, D], q's dtype). No host sync.
    query_start_loc may start above 0 (a mixed batch with its decode rows first): rows outside
    query_start_loc[0]:query_start_loc[-1] are neither read nor written.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be [num_blocks, 2, block_size, H, D], got {kv_cache.shape}"
        )
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} must be [T, Hq, {head_dim}]")
    num_tokens, num_heads, _ = q.shape
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads}")
    num_seqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc {tuple(query_start_loc.shape)} must be [B + 1] for seq_lens "
            f"{tuple(seq_lens.shape)} = [B]"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} must be [{num_seqs}, W]")
    for name, t in (
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
    ):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_tables must be contiguous in their last dim")
    fresh = k is not None or v is not None
    if fresh:
        if k is None or v is None:
            raise ValueError("a fresh prefill needs both k and v")
        want = (num_tokens, num_kv_heads, head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be {want}")
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("k and v must be contiguous in their last dim")
    else:
        k = v = q  # unused by the paged variant
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be {tuple(q.shape)}, contiguous in head_dim")
    if num_tokens == 0 or num_seqs == 0:
        return out
    if fresh and (tma if tma is not None else prefill_attention_tma.usable(q, k, v, out)):
        return prefill_attention_tma.fresh_attention_tma(
            q, k, v, out, query_start_loc, scale, max_query_len
        )
    if not fresh and (
        tma if tma is not None else prefill_attention_tma.paged_usable(q, kv_cache, out)
    ):
        if block_size % prefill_attention_tma.PAGE_BLOCK_N:
            raise ValueError(
                f"the paged TMA kernel needs blocks of a multiple of "
                f"{prefill_attention_tma.PAGE_BLOCK_N} tokens, got {block_size}"
            )
        return prefill_attention_tma.paged_attention_tma(
            q, kv_cache, out, query_start_loc, seq_lens, block_tables, scale, max_query_len
        )

    block_m, block_n, num_warps, num_stages = _tile_config(head_dim, max_query_len, fresh)
    # Enough for every sequence's tiles when query_start_loc[-1] <= T (see varlen_tiles.program_tile).
    num_tiles = num_tokens // block_m + num_seqs
    _prefill_kernel[(num_tiles * num_heads,)](
        q,
        kv_cache,
        k,
        v,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * LOG2E,
        num_seqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_HEADS=num_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PAGE_SIZE=block_size,
        DOT_PRECISION=dot_precision(q.dtype),
        FRESH=fresh,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
