"""Paged attention on the GPU with ember's Triton kernels: one scatter of the step's K/V into the
cache, split-K flash decoding for the single-token rows, and varlen flash attention for the rest:
through the cache for sequences with a cached prefix, from this step's K and V for fresh ones.

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
    fuses_kv_write = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
    ) -> torch.Tensor:
        if not kv_written:
            write_kv(kv_cache, k, v, metadata.slot_mapping)
        out = torch.empty_like(q)
        nd = metadata.num_decodes
        groups = metadata.decode_groups
        if nd:
            decode_attention(
                q[:nd],
                kv_cache,
                metadata.seq_lens[:nd],
                metadata.block_tables[:nd],
                scale,
                out=out[:nd],
                max_seq_len=metadata.max_seq_len,
                row_groups=None if groups is None else groups[:nd],
                max_group=metadata.max_decode_group,
            )
        for first, end, fresh in self._prefill_runs(metadata, nd):
            # The prefill rows keep their absolute offsets into q and out.
            prefill_attention(
                q,
                kv_cache,
                metadata.query_start_loc[first : end + 1],
                metadata.seq_lens[first:end],
                metadata.block_tables[first:end],
                scale,
                max_query_len=metadata.max_query_len,
                out=out,
                k=k if fresh else None,
                v=v if fresh else None,
            )
        return out

    @staticmethod
    def _prefill_runs(md: AttentionMetadata, nd: int) -> list[tuple[int, int, bool]]:
        """The prefill rows as runs [first, end) of fresh sequences (no cached prefix: their
        keys are this step's k and v rows) and of the others (read through the cache)."""
        qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
        runs: list[tuple[int, int, bool]] = []
        for i in range(nd, md.num_seqs):
            fresh = lens[i] == qsl[i + 1] - qsl[i]
            if runs and runs[-1][2] == fresh:
                runs[-1] = (runs[-1][0], i + 1, fresh)
            else:
                runs.append((i, i + 1, fresh))
        return runs
