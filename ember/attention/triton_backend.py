"""Paged attention on the GPU with ember's Triton kernels: one scatter of the step's K/V into the
cache, split-K flash decoding for the single-token rows, and varlen flash attention for the rest:
through the cache for sequences with a cached prefix, from this step's K and V for fresh ones.

The batch arrives with its decode rows first (`metadata.num_decodes`); the decode path reads no
host data, so a decode-only step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.attention.backend import AttentionBackend
from ember.attention.metadata import AttentionMetadata
from ember.kernels.decode_attention import decode_attention
from ember.kernels.kv_write import write_kv
from ember.kernels.prefill_attention import prefill_attention


@dataclass(slots=True)
class _Run:
    """Prefill rows of one kind: sequences [first, end) of the step, fresh or over a cache."""

    query_start_loc: torch.Tensor  # [n + 1], absolute offsets into q and out
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    fresh: bool


@dataclass(slots=True)
class _StepPlan:
    """What every layer's attention takes of one step's metadata, sliced once at its first layer
    (a mixed step on the piecewise graphs launches attention from Python 32 times a step)."""

    metadata: AttentionMetadata
    decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None
    """The decode rows' seq_lens, block tables and row groups; None without decode rows."""
    runs: list[_Run]


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    fuses_kv_write = True

    def __init__(self) -> None:
        self._plan: _StepPlan | None = None

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
        if out is None:
            out = torch.empty_like(q)
        plan = self._plan
        if plan is None or plan.metadata is not metadata:
            plan = self._plan = self._make_plan(metadata)
        nd = metadata.num_decodes
        if plan.decode is not None:
            seq_lens, block_tables, groups = plan.decode
            decode_attention(
                q[:nd],
                kv_cache,
                seq_lens,
                block_tables,
                scale,
                out=out[:nd],
                max_seq_len=metadata.max_seq_len,
                row_groups=groups,
                max_group=metadata.max_decode_group,
            )
        for run in plan.runs:
            # The prefill rows keep their absolute offsets into q and out.
            prefill_attention(
                q,
                kv_cache,
                run.query_start_loc,
                run.seq_lens,
                run.block_tables,
                scale,
                max_query_len=metadata.max_query_len,
                out=out,
                k=k if run.fresh else None,
                v=v if run.fresh else None,
            )
        return out

    @classmethod
    def _make_plan(cls, md: AttentionMetadata) -> _StepPlan:
        nd, groups = md.num_decodes, md.decode_groups
        decode = None
        if nd:
            decode = (
                md.seq_lens[:nd],
                md.block_tables[:nd],
                None if groups is None else groups[:nd],
            )
        runs = [
            _Run(
                md.query_start_loc[first : end + 1],
                md.seq_lens[first:end],
                md.block_tables[first:end],
                fresh,
            )
            for first, end, fresh in cls._prefill_runs(md, nd)
        ]
        return _StepPlan(md, decode, runs)

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
