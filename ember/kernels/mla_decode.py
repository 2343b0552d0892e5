"""Paged MLA decode attention (Triton): one new query token per sequence over the latent cache,
flash-decoding split-K (the reference is ember/attention/mla.py's `mla_attention_ref`).

Every head attends to the same latents (the compressed KV and the shared rope key), so stage 1
runs one program per (sequence, block of BLOCK_H heads, split): it loads each latent tile of its
slice of the context once for all its heads, scores it against each head's latent query and rope
query, and accumulates the softmax-weighted latents; then it writes a normalised partial output
[BLOCK_H, kv_lora_rank] and its log-sum-exp. Stage 2 is decode_attention's merge (the output is
in the latent space; the caller maps it out through W_UV).

Bytes per layer and step: sum(seq_lens) * (kv_lora_rank + rope) * itemsize, read once for all
heads (Kimi K2: 576 values a token against 2 x 64 x 128 for MHA); flops: 2 * sum(seq_lens) *
heads * (2 * kv_lora_rank + rope): at 64 heads ~120 flops per byte, so at large batch this
kernel leans on the tensor cores where MHA decode never does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.decode_attention import choose_num_splits, fp16_dots, merge_splits
from ember.kernels.dispatch import LOG2E, dot_precision, num_sms

MIN_TOKENS_PER_SPLIT = 64
"""Shorter splits than MHA decode's 256: a program walks its split 16 latent rows (576 values for
Kimi) at a time, so at batch 1 a 512-token context in 256-token splits was two programs of 16
serial steps each (24 us a layer on an H200, 0.66 ms of Moonlight's 4.95 ms token); the extra
partials (heads x rank fp32 a split) are small next to that at small batch, and at large batch
the programs-per-SM bound keeps the splits few anyway."""

PROGRAMS_PER_SM = 2
"""Stage-1 programs wanted per SM: half of MHA decode's, since an MLA program carries every head
of its block ([16, 512] fp32 accumulators). benchmarks/probes/mla_decode_sweep.py on an H200, in CUDA
graphs sized for 8k contexts: at 4 a batch of 64 x 1k took 9 splits and 56 us (16 heads), where 4
splits took 40; at 2 the split counts land on the sweep's best (16 heads: batch 1, 8, 64; 64
heads: batch 1 and 8; batch 64 gets 2 where 4 was the best measured). 32 latent rows a tile
(BLOCK_N) beat 16 at every shape but one (within 0.4 us)."""


# Sizes that change from batch to batch (and pointers into sliced tensors) do not specialize:
# one compiled variant serves every batch, so none is compiled on the request path.
@triton.jit(do_not_specialize=["num_splits", "stride_btb", "stride_lb", "stride_lh"])
def _mla_split_kernel(
    ql_ptr,
    qr_ptr,
    cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    part_ptr,
    lse_ptr,
    out_ptr,
    scale_log2,
    num_heads,
    num_splits,
    stride_qlb,
    stride_qlh,
    stride_qrb,
    stride_qrh,
    stride_cb,
    stride_ct,
    stride_btb,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    PAGE: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    # int32 whatever the caller's dtype: the decode graphs hold seq_lens as int64, with which the
    # index arithmetic ran 8% slower (64 heads, 64 x 1,024 tokens, H200: 119 against 110 us).
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    # Each sequence cuts its context into num_splits tile-aligned pieces.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(seq_len, start + split_len)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    lat = tl.arange(0, BLOCK_L)
    l_mask = lat < RANK
    rop = tl.arange(0, BLOCK_R)
    r_mask = rop < ROPE
    ql = tl.load(
        ql_ptr + b * stride_qlb + heads[:, None] * stride_qlh + lat[None, :],
        mask=h_mask[:, None] & l_mask[None, :],
        other=0.0,
    )
    qr = tl.load(
        qr_ptr + b * stride_qrb + heads[:, None] * stride_qrh + rop[None, :],
        mask=h_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    if FP16_DOTS:  # (an FP8 cache: decode_attention.fp16_dots)
        ql = ql.to(tl.float16)
        qr = qr.to(tl.float16)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        page = tl.load(block_tables_ptr + b * stride_btb + n // PAGE, mask=n_mask, other=0)
        rows = page.to(tl.int64) * stride_cb + (n % PAGE).to(tl.int64) * stride_ct
        c = tl.load(
            cache_ptr + rows[:, None] + lat[None, :],
            mask=n_mask[:, None] & l_mask[None, :],
            other=0.0,
        ).to(ql.dtype)  # (an FP8 cache's latents read back to the dots' dtype)
        kr = tl.load(
            cache_ptr + rows[:, None] + RANK + rop[None, :],
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        ).to(qr.dtype)
        s = tl.dot(ql, tl.trans(c), input_precision=DOT_PRECISION) + tl.dot(
            qr, tl.trans(kr), input_precision=DOT_PRECISION
        )
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new
    # An empty split (a short context among long ones) has l_i == 0: zeros and lse -inf.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_mask = h_mask[:, None] & l_mask[None, :]
    if WRITE_LSE:
        tl.store(
            part_ptr
            + b.to(tl.int64) * stride_pb
            + heads[:, None] * stride_ph
            + split * stride_ps
            + lat[None, :],
            o,
            mask=o_mask,
        )
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=h_mask)
    else:
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + lat[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=o_mask,
        )


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    block_h: int = 16,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Decode attention of one query a sequence over its paged latents: q_latent [B, H, L]
    (q_nope @ W_UK), q_rope [B, H, R], cache one layer's [num_blocks, 1, page, 1, L + R];
    returns [B, H, L] in q_latent's dtype. CUDA-graph safe (nothing read back on the host);
    num_splits defaults to choose_num_splits over the head blocks, sized by max_seq_len."""
    batch, num_heads, rank = q_latent.shape
    rope = q_rope.shape[2]
    if cache.dim() != 5 or cache.shape[1] != 1 or cache.shape[3] != 1:
        raise ValueError(
            f"expected a latent cache [blocks, 1, page, 1, D], got {tuple(cache.shape)}"
        )
    if cache.shape[4] != rank + rope or cache.stride(4) != 1:
        raise ValueError(
            f"latent cache rows of {cache.shape[4]} values (stride {cache.stride(4)}), "
            f"expected {rank} + {rope} contiguous"
        )
    if q_latent.stride(2) != 1 or q_rope.stride(2) != 1:
        raise ValueError("q_latent and q_rope need a contiguous last dimension")
    page = cache.shape[2]
    if out is None:
        out = torch.empty_like(q_latent)
    if batch == 0:
        return out
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        longest = max_seq_len if max_seq_len is not None else block_tables.shape[1] * page
        sms = num_sms(q_latent) if q_latent.is_cuda else 1
        num_splits = choose_num_splits(
            batch, head_blocks, longest, sms, MIN_TOKENS_PER_SPLIT, PROGRAMS_PER_SM
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    block_l = max(16, triton.next_power_of_2(rank))
    block_r = max(16, triton.next_power_of_2(rope))
    block_n = block_n or 32
    if num_splits > 1:
        part = torch.empty(
            batch, num_heads, num_splits, rank, dtype=torch.float32, device=q_latent.device
        )
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q_latent.device)
    else:
        part, lse = out, out  # unused: stage 1 writes the output
    _mla_split_kernel[(batch, head_blocks, num_splits)](
        q_latent,
        q_rope,
        cache,
        seq_lens,
        block_tables,
        part,
        lse,
        out,
        scale * LOG2E,
        num_heads,
        num_splits,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        cache.stride(0),
        cache.stride(2),
        block_tables.stride(0),
        part.stride(0) if num_splits > 1 else 0,
        part.stride(1) if num_splits > 1 else 0,
        part.stride(2) if num_splits > 1 else 0,
        lse.stride(0) if num_splits > 1 else 0,
        lse.stride(1) if num_splits > 1 else 0,
        out.stride(0),
        out.stride(1),
        PAGE=page,
        RANK=rank,
        ROPE=rope,
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        WRITE_LSE=num_splits > 1,
        DOT_PRECISION=dot_precision(q_latent.dtype),
        FP16_DOTS=fp16_dots(q_latent, cache),
        num_warps=num_warps,
    )
    if num_splits > 1:
        merge_splits(part, lse, out, triton.next_power_of_2(rank))
    return out
