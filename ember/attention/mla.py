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

from ember.attention.metadata import AttentionMetadata
from ember.attention.torch_backend import gather_planes, query_block_rows
from ember.kernels.dispatch import use_triton


def write_latent(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new latent rows [T, D] into their slots of one layer's cache [B, 1, bs, 1, D]."""
    block_size = cache.shape[2]
    cache[slot_mapping // block_size, 0, slot_mapping % block_size, 0] = latent.to(cache.dtype)


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


def mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's latents [T, L + R] into their slots, then attend: on a GPU the decode
    rows (the first `num_decodes` sequences) through the Triton kernel and the other rows through
    the reference; a decode-only step reads nothing on the host (CUDA-graph safe)."""
    if not use_triton(q_latent):
        write_latent(cache, latent, metadata.slot_mapping)
        return mla_attention_ref(q_latent, q_rope, cache, metadata, scale)
    from ember.kernels.kv_write import write_kv
    from ember.kernels.mla_decode import mla_decode

    write_kv(cache, latent.unsqueeze(1), None, metadata.slot_mapping)  # slot -1: padding, skipped
    out = torch.empty_like(q_latent)
    nd = metadata.num_decodes
    if nd:
        mla_decode(
            q_latent[:nd],
            q_rope[:nd],
            cache,
            metadata.seq_lens[:nd],
            metadata.block_tables[:nd],
            scale,
            out=out[:nd],
            max_seq_len=metadata.max_seq_len,
        )
    if nd < metadata.num_seqs:
        mla_attention_ref(q_latent, q_rope, cache, metadata, scale, out=out, first_seq=nd)
    return out
