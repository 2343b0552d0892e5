"""Paged attention in plain PyTorch: the CPU path and the reference the GPU kernels are tested on."""

from __future__ import annotations

import torch

from ember.attention.backend import AttentionBackend
from ember.attention.metadata import AttentionMetadata


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V rows into their slots (block_id * block_size + offset)."""
    block_size = kv_cache.shape[2]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache[blocks, 0, offsets] = k.to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = v.to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, [seq_len, num_kv_heads, head_dim] each, read through its blocks."""
    block_size = kv_cache.shape[2]
    nb = -(-seq_len // block_size)
    blocks = kv_cache[block_table[:nb].long()]  # [nb, 2, block_size, H, D]
    k = blocks[:, 0].reshape(nb * block_size, *blocks.shape[-2:])[:seq_len]
    v = blocks[:, 1].reshape(nb * block_size, *blocks.shape[-2:])[:seq_len]
    return k, v


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context (fp32 math)."""
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    qsl = metadata.query_start_loc_cpu
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        qs, qe = qsl[i], qsl[i + 1]
        if qe == qs:
            continue
        k, v = gather_kv(kv_cache, metadata.block_tables[i], seq_len)
        group = num_heads // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        qi = q[qs:qe].float()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        # Query j sits at position seq_len - q_len + j and sees keys at positions <= its own.
        q_pos = torch.arange(seq_len - (qe - qs), seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        scores.masked_fill_((k_pos > q_pos).unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.slot_mapping)
        return paged_attention_ref(q, kv_cache, metadata, scale)
