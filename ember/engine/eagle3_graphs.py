"""CUDA graphs of an EAGLE-3 head's chained draft steps (ember/spec_decode/eagle3_chain.py), one a
batch size: the K - 1 steps after each row's first draft replay as one launch, with no host work
between them (run eagerly they cost 2.2-2.4 ms of host time a step at batch 1 on an H200).

The inputs live in static buffers: each row's first draft, the head's hidden state and the last
position it wrote, its block table, and whether the row is real. A batch of n rows pads up to the
next captured size; the padding rows write no KV. Off a GPU nothing is captured and `run` calls
the same chain on the same buffers: the path the CPU's tests compare with the eager chain."""

from __future__ import annotations

import torch

from ember.attention.backend import AttentionBackend
from ember.engine.cuda_graphs import CAPTURE_MODE, cuda_graph_sizes
from ember.spec_decode.eagle3_chain import DraftHead, chain_drafts


class ChainGraphs:
    """The chain of `k` drafts for batches up to `max_batch` rows over contexts of up to
    `max_seq_len` tokens and block tables up to `max_blocks` wide."""

    def __init__(
        self,
        head: DraftHead,
        hidden_size: int,
        backend: AttentionBackend,
        block_size: int,
        k: int,
        max_batch: int,
        max_seq_len: int,
        max_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.head, self.backend, self.block_size, self.k = head, backend, block_size, k
        self.max_seq_len = max_seq_len
        self.sizes = cuda_graph_sizes(max_batch)
        top = self.sizes[-1]
        self._first = torch.zeros(top, dtype=torch.int64, device=device)
        self._hidden = torch.zeros(top, hidden_size, dtype=dtype, device=device)
        self._last = torch.zeros(top, dtype=torch.int64, device=device)
        self._tables = torch.zeros(top, max_blocks, dtype=torch.int32, device=device)
        self._valid = torch.zeros(top, dtype=torch.bool, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def size_for(self, n: int) -> int | None:
        """The captured size n rows pad up to; None past the largest."""
        return next((s for s in self.sizes if s >= n), None)

    def _chain(self, size: int, kv_cache: torch.Tensor) -> torch.Tensor:
        return chain_drafts(
            self.head,
            kv_cache,
            self.backend,
            self.block_size,
            self._first[:size],
            self._hidden[:size],
            self._last[:size],
            self._tables[:size],
            self.k,
            self.max_seq_len,
            valid=self._valid[:size],
        )

    @torch.inference_mode()
    def capture(self, kv_cache: torch.Tensor, pool: object | None = None) -> None:
        """Capture every size over the head's KV cache `kv_cache` (on a GPU; after the Triton
        variants the chain launches are compiled: one eager run a size does it)."""
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(kv_cache.device)
        for size in reversed(self.sizes):
            self._chain(size, kv_cache)  # (lazy set-up and compiles, outside the capture)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=pool, capture_error_mode=CAPTURE_MODE)
                try:
                    out = self._chain(size, kv_cache)
                finally:
                    graph.capture_end()
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(
        self,
        first: torch.Tensor,
        hidden: torch.Tensor,
        last_pos: torch.Tensor,
        block_tables: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Drafts [n, k] of n rows (as chain_drafts takes them): the captured graph of the next
        size up replayed on the rows staged into its buffers, or off a GPU the chain run on
        them. A batch past the largest size, or a wider block table, is a ValueError."""
        n, width = first.shape[0], block_tables.shape[1]
        size = self.size_for(n)
        if size is None or width > self._tables.shape[1]:
            raise ValueError(
                f"{n} rows with block tables {width} wide: the chain's graphs take up to "
                f"{self.sizes[-1]} rows and {self._tables.shape[1]} blocks"
            )
        self._first[:n].copy_(first)
        self._hidden[:n].copy_(hidden)
        self._last[:n].copy_(last_pos)
        self._tables[:n, :width].copy_(block_tables)
        self._tables[:n, width:] = 0
        self._valid[:n] = True
        self._valid[n:size] = False
        self._last[n:size] = 0
        self._tables[n:size] = 0
        if size in self._graphs:
            graph, out = self._graphs[size]
            graph.replay()
        else:
            out = self._chain(size, kv_cache)
        return out[:n]
