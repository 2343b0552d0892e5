"""Paged attention on the GPU with ember's Triton kernels: one scatter of the step's K/V into the
cache, split-K flash decoding for the single-token rows, and varlen flash attention for the rest.

The batch arrives with its decode rows first (`metadata.num_decodes`); the decode path reads no
host data, so a decode-only step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from ember.attention.backend import AttentionBackend
from ember.attention.metadata import AttentionMetadata
from ember.kernels.decode_attention import decode_attention
from ember.kernels.kv_write import write_kv
from ember.kernels.prefill_attention import prefill_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

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
        out = torch.empty_like(q)
        nd = metadata.num_decodes
        if nd:
            decode_attention(
                q[:nd],
                kv_cache,
                metadata.seq_lens[:nd],
                metadata.block_tables[:nd],
                scale,
                out=out[:nd],
                max_seq_len=metadata.max_seq_len,
            )
        if nd < metadata.num_seqs:
            # The prefill rows keep their absolute offsets into q and out.
            prefill_attention(
                q,
                kv_cache,
                metadata.query_start_loc[nd:],
                metadata.seq_lens[nd:],
                metadata.block_tables[nd:],
                scale,
                max_query_len=metadata.max_query_len,
                out=out,
            )
        return out
