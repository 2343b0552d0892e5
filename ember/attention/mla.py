"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over a paged latent cache, in PyTorch.

Each token keeps one vector a layer: the normed compressed KV (kv_lora_rank values) and the rope
key shared by every head (qk_rope_head_dim), in a one-plane cache
`[num_blocks, 1, block_size, 1, kv_lora_rank + qk_rope_head_dim]` (`ModelConfig.kv_cache_dims`).
Attention runs in the latent space with the up-projections absorbed: a head's no-rope query is
mapped into the latent space (q_nope @ W_UK), scores are that against the cached latents plus the
rope query against the cached rope keys, and the softmax-weighted latents are mapped out by W_UV
after. This is the CPU path and the reference a GPU kernel is tested on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from ember.attention.metadata import AttentionMetadata
from ember.attention.torch_backend import gather_planes, query_block_rows
from ember.kernels.dispatch import use_triton
from ember.kernels.kv_dtype import to_cache


def write_latent(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new latent rows [T, D] into their slots of one layer's cache [B, 1, bs, 1, D]."""
    block_size = cache.shape[2]
    cache[slot_mapping // block_size, 0, slot_mapping % block_size, 0] = to_cache(
        latent, cache.dtype
    )


def gather_latent(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's latents, [seq_len, D], read through its blocks."""
    return gather_planes(cache, block_table, seq_len)[0, :, 0]


def mla_attention_ref(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    first_seq: int = 0,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged latent context (fp32 math):
    q_latent [T, H, L] (q_nope already through W_UK), q_rope [T, H, R]; returns the attention
    output in the latent space, [T, H, L] (the caller applies W_UV). Sequences before
    `first_seq` are left to the caller (the decode kernel's rows)."""
    num_heads, rank = q_latent.shape[1], q_latent.shape[2]
    out = torch.empty_like(q_latent) if out is None else out
    qsl = metadata.query_start_loc_cpu
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        if i < first_seq:
            continue
        qs, qe = qsl[i], qsl[i + 1]
        if qe == qs:
            continue
        ctx = gather_latent(cache, metadata.block_tables[i], seq_len).float()
        c_kv, k_rope = ctx[:, :rank], ctx[:, rank:]
        first_pos = seq_len - (qe - qs)  # query j sits at first_pos + j
        rows = query_block_rows(num_heads, seq_len)
        for b0 in range(qs, qe, rows):
            b1 = min(qe, b0 + rows)
            end = first_pos + (b1 - qs)  # the block's last query sees keys 0..end-1
            scores = torch.einsum("thl,sl->hts", q_latent[b0:b1].float(), c_kv[:end])
            scores += torch.einsum("thr,sr->hts", q_rope[b0:b1].float(), k_rope[:end])
            mask = torch.ones(b1 - b0, end, dtype=torch.bool, device=scores.device)
            mask = mask.tril(end - (b1 - b0))
            probs = (scores * scale).masked_fill(~mask, float("-inf")).softmax(dim=-1)
            out[b0:b1] = torch.einsum("hts,sl->thl", probs, c_kv[:end]).to(out.dtype)
    return out


EXPAND_MIN_QUERY = 128
"""Prefill rows of a sequence with at least this many new tokens expand the latent context to
per-head K and V and run flash-style attention; shorter runs (extends, verifications) attend in
the latent space. Expanding costs L * H * rank * (nope + v) * 2 flops for a context of L tokens;
attending absorbed costs about q_len * H * L * (2 * rank + rope) * 2, so for Kimi K2's dims
(rank 512, rope 64, nope 128, v 128) expanding wins from about 150 new tokens up."""


EXPAND_CHUNK = 8192
"""Context tokens expanded to per-head K and V at a time: a cached prefix is attended in chunks
of this many tokens and the new tokens as one causal block, each with its log-sum-exp, merged
after (as flash attention merges its tiles). A chunk of Kimi K2.5's 64 heads is 8192 x 64 x
(192 + 128) x 2 bytes = 336 MB, whatever the context: a 128k-token one never holds its whole
expansion (10.7 GB)."""


def mla_prefill_expanded(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    seqs: list[int],
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    chunk: int | None = None,
) -> None:
    """Causal attention of sequences `seqs` with K and V expanded per head from their latent
    context, as the model was trained: K = [c_kv @ W_UK^T, k_rope] and V = c_kv @ W_UV^T. A
    context of up to `chunk` (EXPAND_CHUNK) tokens is expanded whole and runs torch's fused
    attention in one call (causal, or bottom-right causal over a cached prefix); a longer one
    attends its cached prefix's chunks (which every new token sees whole) and the new tokens
    (causal among themselves) apart, merged by their log-sum-exp. q_nope [T, H, nope], q_rope [T, H, R]; w_uk [H, nope, L], w_uv [H, v, L];
    writes out [T, H, v] rows of those sequences."""
    # Imported here: torch.nn.attention.bias imports triton, which the CPU path never needs.
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    chunk = chunk or EXPAND_CHUNK
    num_heads, nope, rank = w_uk.shape
    rope = q_rope.shape[2]
    # K in one batched matmul over the whole latent row: [W_UK, 0; 0, I] maps [c_kv, k_rope] to
    # [k_nope, k_rope] for every head, exactly (the extra terms are zeros and ones), instead of a
    # matmul and a concat of the head-broadcast rope key (10 of Moonlight's 180 ms of an
    # 8 x 2048 prefill on an H200 went to that concat).
    w_k = torch.zeros(num_heads, nope + rope, rank + rope, dtype=w_uk.dtype, device=w_uk.device)
    w_k[:, :nope, :rank] = w_uk
    w_k[:, nope:, rank:] = torch.eye(rope, dtype=w_uk.dtype, device=w_uk.device)

    def expand(ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.einsum("sd,hkd->hsk", ctx, w_k)
        v = torch.einsum("sl,hvl->hsv", ctx[:, :rank], w_uv)
        return k, v

    qsl = metadata.query_start_loc_cpu
    for i in seqs:
        qs, qe, seq_len = qsl[i], qsl[i + 1], metadata.seq_lens_cpu[i]
        first = seq_len - (qe - qs)  # cached tokens before the new ones
        ctx = gather_latent(cache, metadata.block_tables[i], seq_len).to(q_nope.dtype)
        q = torch.cat([q_nope[qs:qe], q_rope[qs:qe]], dim=-1).transpose(0, 1)
        if seq_len <= chunk and first == 0 and seq_len >= CUDNN_MIN_TOKENS and cudnn_takes(q):
            # A fresh prompt, long enough that cuDNN's kernel pays: at a bucketed length, so
            # its plans are few (`cudnn_bucket`). Padded rows come last: no real query sees them.
            pad = cudnn_bucket(seq_len) - seq_len
            k, v = expand(F.pad(ctx, (0, 0, 0, pad)))
            o = attention_lse(F.pad(q, (0, 0, 0, pad)), k, v, True, scale)[0][:, :seq_len]
        elif seq_len <= chunk:  # the whole context expanded at once
            k, v = expand(ctx)
            with sdpa_kernel(NO_CUDNN):
                o = F.scaled_dot_product_attention(
                    q.unsqueeze(0),
                    k.unsqueeze(0),
                    v.unsqueeze(0),
                    attn_mask=None if first == 0 else causal_lower_right(qe - qs, seq_len),
                    is_causal=first == 0,
                    scale=scale,
                )[0]
        else:
            # The queries padded to a bucketed count (cuDNN's plans: one per bucket and key
            # count); whole chunks of the prefix and the causal block of the new tokens (padded
            # alike, last) through cuDNN, a last part-chunk of the prefix through the
            # memory-efficient kernel (no plan for a key count met once).
            n = qe - qs
            pad = cudnn_bucket(n) - n if cudnn_takes(q) else 0
            qp = F.pad(q, (0, 0, 0, pad))
            acc = None  # the parts merged as they come (merge_lse_into): memory of one part
            for c0 in range(0, first, chunk):
                c1 = min(first, c0 + chunk)
                part = attention_lse(qp, *expand(ctx[c0:c1]), False, scale, c1 - c0 < chunk)
                acc = merge_lse_into(acc, part)
            block = attention_lse(qp, *expand(F.pad(ctx[first:], (0, 0, 0, pad))), True, scale)
            o = merge_lse_into(acc, block)[0][:, :n].to(q.dtype)
        out[qs:qe] = o.transpose(0, 1)


CUDNN_MIN_TOKENS = 1024
"""A fresh prompt of at least this many tokens (and at most EXPAND_CHUNK) attends through
cuDNN's kernel at a bucketed length; shorter ones, and new tokens over a cached prefix, through
the memory-efficient kernel (NO_CUDNN). Per layer on an H200, causal, bf16, q/k 192 and v 128
(`benchmarks/probes/mla_attention_backends.py`), 16 heads: 0.11 against 0.084 ms at 1,024
tokens, 0.76 against 0.24 at 4,096, 2.57 against 0.68 at 8,192; 64 heads 9.6 against 2.3 ms at
8,192. cuDNN's first call at a new shape builds its plan: 58-65 ms."""


def cudnn_bucket(n: int) -> int:
    """The length a fresh prompt of n tokens is padded to for cuDNN's attention: n rounded up to
    a quarter of its power-of-two octave (1,025-1,280 -> 1,280; 3,000 -> 3,072; 8,000 -> 8,192),
    at most a quarter more work, and 13 lengths (13 plans) from 1,024 to 8,192 tokens."""
    step = max(256, 1 << (n.bit_length() - 3))
    return -(-n // step) * step


def cudnn_takes(q: torch.Tensor) -> bool:
    """Whether cuDNN's attention serves queries like q [H, T, D] (attention_lse's fast path)."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0


def warm_cudnn_plans(
    num_heads: int, qk_dim: int, v_dim: int, dtype: torch.dtype, device: torch.device, limit: int
) -> int:
    """Build cuDNN's plan for every bucketed fresh-prompt length up to `limit` tokens (the
    start-up's, so that no prompt pays one): attention of zeros at each. Returns how many (none
    where cuDNN's attention does not serve: the CPU, float32)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or qk_dim % 8:
        return 0
    lengths = sorted(
        {cudnn_bucket(n) for n in range(CUDNN_MIN_TOKENS, min(limit, EXPAND_CHUNK) + 1)}
    )
    for n in lengths:
        q = torch.zeros(num_heads, n, qk_dim, dtype=dtype, device=device)
        v = torch.zeros(num_heads, n, v_dim, dtype=dtype, device=device)
        attention_lse(q, q, v, True, 1.0)
    return len(lengths)


NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The fused attention backends MLA's expanded prefill may take for a context expanded whole:
not cuDNN's, which torch picks for MLA's head dims (q/k 192, v 128) but which builds a plan for
every new sequence length (a fresh prompt of CUDNN_MIN_TOKENS or more takes it at a bucketed
length instead). On an H200 (Moonlight shape, a fresh prompt alone) a length met
before took 18.5 ms and a new one 74-90 ms at 133-150 tokens, 80 ms at 1,003, 102-116 ms at
3,000; without cuDNN 12.5-16 ms, 23 ms and 48-50 ms, every length alike (an agent's every turn
is a new length). At 8,000 tokens cuDNN's kernel, its plan made, was the faster (104 against
150 ms), so the chunked path past EXPAND_CHUNK keeps it (`attention_lse`)."""


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    plan_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [H, T, D] over k [H, S, D], v [H, S, Dv] (causal: a square T = S block,
    query j seeing keys 0..j), with each row's log-sum-exp of its scores: (out [H, T, Dv] in
    q's dtype, lse [H, T] float32). On a GPU in bf16 or fp16 with head dims a multiple of 8
    (MLA's 192 and 128) torch's cuDNN attention computes both, the faster kernel but a plan for
    each new shape (callers keep their shapes few: `cudnn_bucket`); `plan_free`, torch's
    memory-efficient kernel instead, for a shape met once. Otherwise float32 math (the CPU, and
    odd test shapes)."""
    n = q.shape[1]
    if cudnn_takes(q) and v.shape[-1] % 8 == 0:
        q, k, v = (x.contiguous().unsqueeze(0) for x in (q, k, v))
        if plan_free:
            o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, causal, scale=scale
            )[:2]
        else:
            o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=scale
            )[:2]
        return o[0], lse[0].reshape(lse.shape[1], -1)[:, :n].float()
    return _attention_lse_math(q, k, v, causal, scale)


def _attention_lse_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n = q.shape[1]
    scores = torch.einsum("htd,hsd->hts", q.float(), k.float()) * scale
    if causal:
        mask = torch.ones(n, k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.einsum("hts,hsv->htv", probs, v.float()).to(q.dtype), lse


def merge_lse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One attention output from attention over disjoint parts of the keys, each (out, lse):
    sum_i out_i * exp(lse_i - logsumexp_i(lse_i))."""
    acc = None
    for part in parts:
        acc = merge_lse_into(acc, part)
    if acc is None:
        raise ValueError("no parts to merge")
    return acc[0].to(parts[0][0].dtype)


def merge_lse_into(
    acc: tuple[torch.Tensor, torch.Tensor] | None, part: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A running merge: `acc` (out in float32, lse; None before the first part) with one more
    part's (out, lse), as merge_lse merges them all. Only the running sum is held, not every
    part: a 256k-token context's 32 chunks at 64 heads would hold 8.6 GB of partial outputs."""
    out, lse = part
    if acc is None:
        return out.float(), lse
    total_out, total_lse = acc
    merged = torch.logaddexp(total_lse, lse)
    total_out.mul_(torch.exp(total_lse - merged).unsqueeze(-1))
    total_out.add_(out.float() * torch.exp(lse - merged).unsqueeze(-1))
    return total_out, merged


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's latents [T, L + R] into their slots, then attend; returns [T, H, v].

    q_nope [T, H, nope] and q_rope [T, H, R] (rotated); w_uk [H, nope, L] and w_uv [H, v, L],
    kv_b_proj's halves. On the CPU every row attends in the latent space through the reference.
    On a GPU: the decode rows (the first `num_decodes` sequences) and the rows of short runs
    through the Triton MLA decode kernel (each row of a run as its own query over its causal
    prefix), long runs expanded (mla_prefill_expanded). A decode-only step reads nothing on the
    host (CUDA-graph safe)."""
    if not use_triton(q_nope):
        write_latent(cache, latent, metadata.slot_mapping)
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        o = mla_attention_ref(q_latent, q_rope, cache, metadata, scale)
        return torch.einsum("thl,hvl->thv", o, w_uv)
    from ember.kernels.kv_write import write_kv
    from ember.kernels.mla_decode import mla_decode

    write_kv(cache, latent.unsqueeze(1), None, metadata.slot_mapping)  # slot -1: padding, skipped
    nd = metadata.num_decodes
    qsl = metadata.query_start_loc_cpu
    long_runs = [i for i in range(nd, metadata.num_seqs) if qsl[i + 1] - qsl[i] >= EXPAND_MIN_QUERY]
    out = torch.empty(*q_nope.shape[:2], w_uv.shape[1], dtype=q_nope.dtype, device=q_nope.device)
    if long_runs:
        mla_prefill_expanded(q_nope, q_rope, cache, metadata, long_runs, w_uk, w_uv, scale, out)
    # Every other row as a decode query: a run's row j sees its sequence's first
    # seq_len - q_len + j + 1 tokens, through the same block table.
    latent_rows = _latent_rows(metadata, nd, set(long_runs))
    if latent_rows is None and nd == 0:
        return out  # every row was expanded
    if latent_rows is None:
        rows, seq_lens, tables = slice(0, nd), metadata.seq_lens[:nd], metadata.block_tables[:nd]
    else:
        rows, seq_lens, tables = latent_rows
    q_latent = torch.einsum("thn,hnl->thl", q_nope[rows], w_uk)  # [H, T, L] under a view
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    o = mla_decode(
        q_latent,
        q_rope[rows].contiguous(),
        cache,
        seq_lens,
        tables,
        scale,
        max_seq_len=metadata.max_seq_len,
    )
    out[rows] = torch.einsum("thl,hvl->thv", o, w_uv)
    return out


def _latent_rows(
    metadata: AttentionMetadata, nd: int, expanded: set[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(row indices, per-row context lengths, per-row block tables) of the rows not expanded, or
    None when they are exactly the decode rows (then the device metadata serves as it is, with
    no host work: the graph-safe path)."""
    qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    runs = [i for i in range(nd, metadata.num_seqs) if i not in expanded and qsl[i + 1] > qsl[i]]
    if not runs:
        return None
    rows, row_lens, row_seqs = list(range(nd)), list(lens[:nd]), list(range(nd))
    for i in runs:
        n = qsl[i + 1] - qsl[i]
        rows += range(qsl[i], qsl[i + 1])
        row_lens += range(lens[i] - n + 1, lens[i] + 1)
        row_seqs += [i] * n
    device = metadata.seq_lens.device
    seqs = torch.tensor(row_seqs, device=device)
    return (
        torch.tensor(rows, device=device),
        torch.tensor(row_lens, dtype=metadata.seq_lens.dtype, device=device),
        metadata.block_tables[seqs],
    )
