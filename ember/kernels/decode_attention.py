"""Paged decode attention (Triton): one new query token per sequence, flash-decoding split-K.

Stage 1 runs one program per (sequence, KV head, split): it loads each K/V tile of its slice of the
context once for all Hq/Hkv query heads of that KV head and writes a normalised partial output and
its log-sum-exp. Stage 2 merges the splits. With one split, stage 1 writes the output directly.

The two numbers, per layer and step: bytes = sum(seq_lens) * Hkv * D * 2 (K and V) * itemsize,
plus q and out (B * Hq * D * itemsize each) and the fp32 partials (B * Hq * splits * (D + 1) * 4,
written and read once); flops = 4 * sum(seq_lens) * Hq * D. That is Hq/Hkv flops per byte (a
handful), far under the tensor cores' ~300 per byte, so decode is bound by memory bandwidth.
Llama-3-8B, bf16, batch 64 at 4096 tokens: 1.07 GB of K/V and 4.3 GFLOP, so a floor of ~0.36 ms
on an H100 (~3.0 TB/s measured copy) and ~0.25 ms on an H200 (~4.3 TB/s); compute is ~5 us.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ember.kernels.dispatch import LOG2E, dot_precision, num_sms

# A split shorter than this spends more on its prologue and partials than it saves in parallelism:
# at 256 tokens its partials (Hq/Hkv * (D + 1) fp32, written and read) are ~3% of its K/V bytes.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# Stage-1 programs wanted per SM: two fit at once (~100 KB of shared memory each, see _block_n),
# and more of them even out a batch of uneven contexts, where one split's work is proportional to
# its sequence's length.
PROGRAMS_PER_SM = 4
# Stage 1's warps, pipeline depth and grid order, measured on an H200 (8B shape, pages of 64, the
# engine's cache layout; `benchmarks/probes/decode_attention_sweep.py --layouts`). The
# kernel's speed depended on the dtype of seq_lens, which the kernel now casts to int32: the decode
# graphs pass int64 and the eager path int32, and with 2 stages in row order 256 rows x 1,152
# tokens took 278 us a layer with int64 and 300 with int32; 3 stages with one row's KV heads on
# neighbouring programs (their K/V rows are neighbours in the cache), int32: 271 us, and 64 x
# 1,024 65 against 74. In the engine's mixed load the decode phase took 4.16-4.17 s against
# 4.19 s before (two A/B pairs, same lease).
#
# These settings are read at each call: `benchmarks/probes/profile_mixed.py --decode-attention` sets them
# for a whole engine, `benchmarks/probes/decode_attention_sweep.py` for one call at a time.
NUM_WARPS = 4
NUM_STAGES = 3
HEAD_MAJOR = True
BLOCK_N: int | None = None
"""Keys a tile; None: `_block_n(head_dim, itemsize)`."""
MAX_GRID_Y = 65535


@functools.lru_cache(maxsize=4096)  # a pure function of ints, asked once a layer per eager step
def choose_num_splits(
    batch_size: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int = 132,
    min_tokens: int = MIN_TOKENS_PER_SPLIT,
    programs_per_sm: int | None = None,
) -> int:
    """Splits per sequence so that stage 1 has about `programs_per_sm` programs per SM (None:
    the module's PROGRAMS_PER_SM, which `benchmarks/probes/profile_mixed.py --decode-splits-per-sm` sets
    for a whole engine, clearing this function's cache).

    Never more than one split per `min_tokens` tokens of the longest context: past that,
    each split's fixed cost (q load, partials written and merged) outweighs the extra parallelism.
    """
    if batch_size <= 0 or num_kv_heads <= 0:
        raise ValueError(f"batch_size {batch_size} and num_kv_heads {num_kv_heads} must be > 0")
    per_sm = PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    want = triton.cdiv(per_sm * num_sms, batch_size * num_kv_heads)
    by_len = triton.cdiv(max(max_seq_len, 1), min_tokens)
    return max(1, min(want, by_len, MAX_SPLITS))


def fp16_dots(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether an attention kernel's dots take fp16 operands: over an FP8 cache with bf16 or fp16
    queries, since the hardware converts FP8 to fp16 in one instruction a pair (to bf16 through
    float32). The queries and probabilities fit fp16's range; its mantissa is wider than bf16's."""
    return kv_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32


def _block_n(head_dim: int, itemsize: int = 2) -> int:
    # Keys per tile: a 64 x 128 bf16 K tile is 16 KB; with V and 3 pipeline stages, 96 KB of
    # loads in flight per program, well above the ~20 KB per SM that hides HBM latency at full
    # bandwidth. Wider heads take fewer keys to keep two programs per SM. (128 keys a tile: as
    # fast at batch 256, slower at 128 x 2048 and at batches of 8 and 64 on an H200.) An FP8
    # cache takes twice the keys, the same bytes: 32 rows x 8,000 tokens of the 8B shape in 257
    # against 282 us a layer (`benchmarks/probes/fp8_kv_decode.py`).
    keys = 64 if head_dim <= 128 else 32
    return keys * 2 if itemsize == 1 else keys


# Sizes that change from batch to batch (and pointers into sliced tensors) do not specialize:
# one compiled variant serves every batch, so none is compiled on the request path.
@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_lb", "stride_lh"])
def _decode_split_kernel(
    q_ptr,
    kv_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    groups_ptr,  # [B] rows in the group a row leads (0: led by an earlier row); unused if QMAX == 1
    out_ptr,  # [B, Hq, S, D] fp32 partials, or the final [B, Hq, D] output when S == 1
    lse_ptr,  # [B, Hq, S] fp32 (log2 domain); unused when WRITE_LSE is False
    qk_scale,  # softmax scale * log2(e): the kernel works in exp2
    num_splits,
    stride_qb,
    stride_qh,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_tok,
    stride_cache_head,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    QMAX: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
    FP16_DOTS: tl.constexpr,
):
    if HEAD_MAJOR:  # one row's KV heads on neighbouring programs
        kv_head = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The program's query rows: row b and, with row groups (a verification's k + 1 positions of
    # one request), the rows it leads; each tile row is one (row, query head) pair, so a group
    # reads its shared context once. Row r of a group sees keys below its own seq_len.
    num_rows = 1 if QMAX == 1 else tl.load(groups_ptr + b)
    i = tl.arange(0, BLOCK_G)
    r = i // GROUP
    heads = kv_head * GROUP + i % GROUP
    d = tl.arange(0, BLOCK_D)
    g_mask = (r < num_rows) & (i < QMAX * GROUP)
    d_mask = d < HEAD_DIM
    # int32 whatever the caller's dtype: the decode graphs hold seq_lens as int64, which made the
    # loop's index arithmetic 64-bit.
    row_lens = tl.load(seq_lens_ptr + b + r, mask=g_mask, other=0).to(tl.int32)
    seq_len = tl.max(row_lens, 0)  # the group's longest context (0 for a led row's program)
    # Each sequence cuts its own context into num_splits tile-aligned pieces, so a long context
    # gets short pieces; for a short one the trailing splits are empty and write only lse = -inf.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    q_rows = (b + r).to(tl.int64) * stride_qb
    q = tl.load(
        q_ptr + q_rows[:, None] + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if FP16_DOTS:
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    kv_base = kv_ptr + kv_head * stride_cache_head
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        # Page lookup per key: a tile may span several blocks (or part of one), and the repeated
        # table reads of one block hit L1.
        block = tl.load(table + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = block * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_tok
        ptrs = kv_base + rows[:, None] + d[None, :]
        mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(ptrs, mask=mask, other=0.0).to(q.dtype)
        v = tl.load(ptrs + stride_cache_kv, mask=mask, other=0.0).to(q.dtype)

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(n_mask[None, :] & (pos[None, :] < row_lens[:, None]), qk, float("-inf"))
        # A group's shorter rows (and padding rows) may have no key in a tile: m_safe keeps
        # their exponents at exp2(-inf) = 0 rather than NaN.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (l_i == 0, acc == 0, m_i == -inf) writes zeros and lse = -inf; stage 2 gives
    # it weight 0, and a sequence with no context at all (a padding row) gets zeros, not NaN.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_rows = (b + r).to(tl.int64) * stride_ob
    o_ptrs = out_ptr + o_rows[:, None] + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if WRITE_LSE:
        lse = m_i + tl.log2(l_safe)
        l_rows = (b + r).to(tl.int64) * stride_lb
        tl.store(lse_ptr + l_rows + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"])
def _decode_merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
    live = lse > float("-inf")
    # The floor keeps m finite when no split has keys, so exp2 gives 0 rather than NaN there.
    m = tl.maximum(tl.max(lse, 0), -1e30)
    w = tl.exp2(lse - m)
    part = tl.load(
        part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=live[:, None] & d_mask[None, :],
        other=0.0,
    )
    num = tl.sum(w[:, None] * part, 0)
    # The split holding the max has weight 1, so den >= 1 unless no split has keys (num == 0).
    o = num / tl.maximum(tl.sum(w, 0), 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_mask
    )


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    row_groups: torch.Tensor | None = None,
    max_group: int = 1,
) -> torch.Tensor:
    """Attention of one query token per sequence over its whole paged context.

    q: [B, Hq, D]; kv_cache: one layer's view [num_blocks, 2, block_size, Hkv, D]; seq_lens: [B]
    context lengths including this token; block_tables: [B, W]. Returns out ([B, Hq, D], q's dtype).
    CUDA-graph safe: nothing here reads device memory on the host. num_splits defaults to
    choose_num_splits(), sized by max_seq_len (a host-side upper bound; W * block_size if None).
    Any num_splits gives the same result, so a graph captured with one stays correct.

    Row groups (speculative verification: a request's k + 1 positions as consecutive rows over the
    same blocks, seq_lens rising by one): row_groups[b] is the number of rows row b leads (1 for a
    plain decode row, k + 1 for a verification's first row, 0 for the rows it leads), at most
    `max_group`. A group's program reads the shared context once for all its rows instead of once
    a row. Led rows must have their leader's block table. The result equals the ungrouped one.
    """
    _check_inputs(q, kv_cache, seq_lens, block_tables)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be {tuple(q.shape)}, contiguous in head_dim")
    if batch == 0:
        return out
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = block_tables.shape[1] * block_size
        sms = num_sms(q) if q.is_cuda else 132
        # With groups of up to max_group rows, at least batch / max_group programs have work.
        programs = triton.cdiv(batch, max(max_group, 1)) if row_groups is not None else batch
        num_splits = choose_num_splits(programs, num_kv_heads, max_seq_len, sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    group = num_heads // num_kv_heads
    qmax = 1 if row_groups is None else max_group
    if qmax < 1:
        raise ValueError(f"max_group must be >= 1, got {max_group}")
    if row_groups is not None and row_groups.shape != (batch,):
        raise ValueError(f"row_groups {tuple(row_groups.shape)} must be [{batch}]")
    block_d = max(16, triton.next_power_of_2(head_dim))
    # tl.dot needs M >= 16; the padded query rows cost MMA work only, and decode is memory-bound.
    # A tile row is one (row of the group, query head) pair.
    block_g = max(16, triton.next_power_of_2(group * qmax))
    if num_splits == 1:
        target, lse = out, out  # lse is unused: WRITE_LSE is off
        target_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        target = torch.empty(
            batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        target_strides = target.stride()[:3]
        lse_strides = lse.stride()[:2]
    # A grid's second dimension holds at most 65,535 programs: past that, rows go first.
    head_major = HEAD_MAJOR and batch <= MAX_GRID_Y
    grid = (num_kv_heads, batch, num_splits) if head_major else (batch, num_kv_heads, num_splits)
    _decode_split_kernel[grid](
        q,
        kv_cache,
        seq_lens,
        block_tables,
        seq_lens if row_groups is None else row_groups,
        target,
        lse,
        scale * LOG2E,
        num_splits,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        *target_strides,
        *lse_strides,
        GROUP=group,
        QMAX=qmax,
        HEAD_DIM=head_dim,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_N=BLOCK_N or _block_n(head_dim, kv_cache.element_size()),
        PAGE_SIZE=block_size,
        WRITE_LSE=num_splits > 1,
        DOT_PRECISION=dot_precision(q.dtype),
        HEAD_MAJOR=head_major,
        FP16_DOTS=fp16_dots(q, kv_cache),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if num_splits > 1:
        merge_splits(target, lse, out, block_d)
    return out


def merge_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, block_d: int) -> None:
    """Stage 2: out[b, h] from the splits' normalised partials part [B, H, S, D] (fp32) and
    their log-sum-exps lse [B, H, S] (base 2; -inf for an empty split)."""
    batch, num_heads, num_splits, head_dim = part.shape
    block_s = triton.next_power_of_2(num_splits)
    _decode_merge_kernel[(batch, num_heads)](
        part,
        lse,
        out,
        num_splits,
        *part.stride()[:3],
        *lse.stride()[:2],
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=block_s,
        BLOCK_D=block_d,
        # At most 32 fp32 partials a thread: 64 splits x 128 dims would spill on 2 warps.
        num_warps=min(8, max(1, block_s * block_d // 1024)),
    )


def _check_inputs(
    q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor
) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be [num_blocks, 2, block_size, H, D], got {kv_cache.shape}"
        )
    if q.dim() != 3 or q.shape[2] != kv_cache.shape[4]:
        raise ValueError(f"q {tuple(q.shape)} must be [B, Hq, {kv_cache.shape[4]}]")
    if q.shape[1] % kv_cache.shape[3] != 0:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {kv_cache.shape[3]}")
    if seq_lens.shape != (q.shape[0],) or block_tables.dim() != 2:
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} must be [{q.shape[0]}] and block_tables 2-D, "
            f"got {tuple(block_tables.shape)}"
        )
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {q.shape[0]} seqs")
    for name, t in (("seq_lens", seq_lens), ("block_tables", block_tables)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_tables must be contiguous in their last dim")
