"""Causal attention of fresh prompts (no cached prefix) with Hopper's tensor memory accelerator.

The FRESH variant of `prefill_attention` reads this step's Q, K and V rows through pointer tiles
(every address computed by the threads, cp.async); this one builds a TMA descriptor per
sequence and loads whole tiles with one instruction each, which frees the registers and issue
slots the address arithmetic took. With them a 128-query tile fits one warpgroup (4 warps) and
two programs share an SM (96 KB of shared memory each with two stages of 64-key K and V tiles),
so one program's softmax overlaps the other's matmuls. bf16, 32 / 8 heads of 128, causal, H100,
TFLOP/s (`benchmarks/attention_kernels.py`): 8 x 2048 397 against 336 for the pointer kernel,
1 x 16384 516 against 434, 16 x 1024 259 against 223 (cuDNN, built per length: 518 / 598 / 419).

The descriptors end at each sequence's last row: a tile's rows past it load as zeros and its
stores there are dropped, so a tile never writes the next sequence's output. Building them
in the kernel takes a little global scratch memory per program, which Triton asks of the
allocator set in the launching thread (a ContextVar), so every launch sets it.
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
    row,
    col,
    n0,
    q_pos,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile of the online softmax; MASKED for the tiles on the causal diagonal."""
    k = k_desc.load([row + n0, col])
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
    v = v_desc.load([row + n0, col])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["num_seqs"])
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
            acc, l_i, m_i, q, k_desc, v_desc, q_start, col, n0, q_pos, qk_scale,
            BLOCK_N, False, DOT_PRECISION,
        )  # fmt: skip
    # Key 0 is in the first tile visited and visible to every row, so no row is all -inf.
    for n0 in range(full_end, tl.minimum(q_len, m0 + BLOCK_M), BLOCK_N):
        acc, l_i, m_i = _key_tile(
            acc, l_i, m_i, q, k_desc, v_desc, q_start, col, n0, q_pos, qk_scale,
            BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip
    o_desc.store([q_start + m0, head * HEAD_DIM], (acc / l_i[:, None]).to(out_ptr.dtype.element_ty))


def tile_config(max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): one warpgroup, two programs an SM (above)."""
    return (64 if max_query_len <= 64 else 128), 64, 4, 2


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
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = query_start_loc.shape[0] - 1
    block_m, block_n, num_warps, num_stages = tile_config(max_query_len)
    triton.set_allocator(_scratch)
    _fresh_tma_kernel[((num_tokens // block_m + num_seqs) * num_heads,)](
        q,
        k,
        v,
        out,
        query_start_loc,
        scale * LOG2E,
        num_seqs,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        out.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=k.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
