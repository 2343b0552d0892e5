"""Paged attention in plain PyTorch: the CPU path and the reference the GPU kernels are tested on."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.attention.backend import AttentionBackend
from ember.attention.metadata import AttentionMetadata
from ember.kernels.kv_dtype import to_cache


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V rows into their slots (block_id * block_size + offset)."""
    block_size = kv_cache.shape[2]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache[blocks, 0, offsets] = to_cache(k, kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = to_cache(v, kv_cache.dtype)


def gather_planes(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's rows of every plane of one layer's cache [num_blocks, planes, block_size,
    H, D] (K and V, or MLA's latents), read through its blocks: [planes, seq_len, H, D]."""
    block_size = kv_cache.shape[2]
    nb = -(-seq_len // block_size)
    blocks = kv_cache[block_table[:nb].long()].transpose(0, 1)  # [planes, nb, block_size, H, D]
    return blocks.reshape(blocks.shape[0], nb * block_size, *blocks.shape[-2:])[:, :seq_len]


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, [seq_len, num_kv_heads, head_dim] each, read through its blocks."""
    k, v = gather_planes(kv_cache, block_table, seq_len)
    return k, v


SCORE_BUDGET = 1 << 24
"""Attention scores (fp32) one query block may hold: 64 MiB. A whole 11k-token prompt's dense
[heads, q, k] matrix took a CPU engine to 5.35 GB; query blocks bound it whatever the prompt."""


def query_block_rows(num_heads: int, seq_len: int) -> int:
    """Queries per block so that one block's scores fit SCORE_BUDGET (at least one row)."""
    return max(1, SCORE_BUDGET // max(1, num_heads * seq_len))


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context (fp32 math),
    in query blocks: memory is bounded by SCORE_BUDGET, not by prompt length squared."""
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    qsl = metadata.query_start_loc_cpu
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        qs, qe = qsl[i], qsl[i + 1]
        if qe == qs:
            continue
        k, v = gather_kv(kv_cache, metadata.block_tables[i], seq_len)
        # [H, L, D]; grouped heads stay grouped (enable_gqa): no repeated copy of K and V.
        k = k.float().transpose(0, 1)
        v = v.float().transpose(0, 1)
        first_pos = seq_len - (qe - qs)  # query j sits at first_pos + j
        rows = query_block_rows(num_heads, seq_len)
        for b0 in range(qs, qe, rows):
            b1 = min(qe, b0 + rows)
            # The block's last query sees keys 0..end-1; earlier ones see fewer (bottom-right).
            end = first_pos + (b1 - qs)
            mask = torch.ones(b1 - b0, end, dtype=torch.bool, device=q.device).tril(end - (b1 - b0))
            o = F.scaled_dot_product_attention(
                q[b0:b1].float().transpose(0, 1),
                k[:, :end],
                v[:, :end],
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
            out[b0:b1] = o.transpose(0, 1).to(q.dtype)
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
        kv_written: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not kv_written:
            write_kv(kv_cache, k, v, metadata.slot_mapping)
        o = paged_attention_ref(q, kv_cache, metadata, scale)
        return o if out is None else out.copy_(o)
