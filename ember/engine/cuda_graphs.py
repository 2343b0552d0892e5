"""CUDA graphs for decode steps: one graph per batch size, replayed on static input buffers that a
step fills with two host-to-device copies, so a decode step costs one launch instead of hundreds.
With speculation, verify steps (k + 1 rows a request, read as one row group by the decode
attention) get graphs of their own: a plain decode step of a speculating engine replays the same
graphs as an engine without speculation (same kernels, same numerics, same speed)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ember.attention.context import ForwardContext
from ember.attention.metadata import AttentionMetadata
from ember.distributed.state import current
from ember.engine.startup_clock import StartupClock
from ember.engine.step_plan import GraphInputs
from ember.engine.warmup import one_layer_of_each_kind
from ember.kernels.precompile import precompile

if TYPE_CHECKING:
    from torch import nn

    from ember.attention.backend import AttentionBackend
    from ember.engine.dp_attention import DataParallelShare
    from ember.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

CAPTURE_MODE = "thread_local"
"""Every capture's error mode (the decode graphs' and the piecewise ones'): only the capturing
thread is barred from calls a capture cannot record. The weights load on a thread of their own
while the graphs are captured (ember/models/loader.py `WeightsLoading`), allocating and copying;
in the default global mode any thread's allocation would end the capture with an error."""


def cuda_graph_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every 8 (a decode batch pads up to the next one)."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


VERIFY_GRAPH_STEP = 64
MAX_VERIFY_ROWS = 512
"""With speculation a verify batch is k + 1 decode rows a request: graphs past the decode sizes,
every 8 rows up to 64 (a small batch's verification pads little: one request verifying 8 drafts is
9 rows, not a 64-row graph), then every 64 rows up to this many."""


def graph_sizes(max_batch: int, max_rows: int = 0) -> list[int]:
    """The decode sizes, then (speculation) every 8 rows up to 64 and every VERIFY_GRAPH_STEP rows
    up to min(max_rows, MAX_VERIFY_ROWS)."""
    sizes = cuda_graph_sizes(max_batch)
    top = min(max_rows, MAX_VERIFY_ROWS)
    if top > sizes[-1]:
        fine = range((sizes[-1] // 8 + 1) * 8, min(top, VERIFY_GRAPH_STEP) + 1, 8)
        sizes += list(fine)
        start = (sizes[-1] // VERIFY_GRAPH_STEP + 1) * VERIFY_GRAPH_STEP
        sizes += list(range(start, top + 1, VERIFY_GRAPH_STEP))
        if sizes[-1] != top:
            sizes.append(top)
    return sizes


def verify_graph_sizes(max_batch: int, max_rows: int) -> list[int]:
    """The verify graphs' sizes: as `graph_sizes`, up to `max_rows` (none without speculation)."""
    return graph_sizes(min(max_batch, max_rows), max_rows) if max_rows > 0 else []


def feed_input_ids(ids: torch.Tensor, src: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """Input ids with the rows whose token is still on the GPU (src >= 0) taken from `prev_tokens`,
    the tokens the previous step sampled: async scheduling launches a step before the host has
    seen the token it decodes."""
    return torch.where(src >= 0, prev_tokens[src.clamp(min=0)], ids)


def feed_row(prev_rows: dict[str, int], request_id: str) -> int:
    row = prev_rows.get(request_id)
    if row is None:
        raise RuntimeError(
            f"request {request_id} decodes a token that the previous step did not sample"
        )
    return row


def fill_rows(
    rows: np.ndarray,
    tables: np.ndarray,
    so: SchedulerOutput,
    order: list[int],
    prev_rows: dict[str, int],
    bs: int,
) -> int:
    """Write the decode batch `order` of `so` into a graph's staging buffers: rows [6, size]
    (input id, position, slot, context length, feed row of async scheduling or -1, row group) and
    block tables [size, W]; returns the rows used. A verification of k drafts takes k + 1 rows."""
    j = 0
    for i in order:
        req, blocks = so.requests[i], so.block_ids[i]
        p = so.num_computed_tokens[i]
        drafts = so.spec_token_ids[i] if so.spec_token_ids else []
        if p < req.num_tokens:
            rows[0, j] = req.all_token_ids[p]
            rows[4, j] = -1
        else:  # the token is the one the previous step sampled for this request
            rows[0, j] = 0
            rows[4, j] = feed_row(prev_rows, req.request_id)
        # A verification of k drafts is k + 1 decode rows over the same blocks, row r at
        # position p + r seeing the positions up to its own (the step writes all of their KV
        # before any attention reads it): a verify batch replays the decode graphs, its first
        # row leading the request's rows (the decode kernel's row group).
        table = np.asarray(blocks, dtype=np.int32)  # once a request, not once a row
        k = len(drafts)
        if k:
            span = slice(j, j + k + 1)
            pos = np.arange(p, p + k + 1)
            rows[0, j + 1 : j + k + 1] = drafts
            rows[4, j + 1 : j + k + 1] = -1
            rows[1, span] = pos
            rows[2, span] = table[pos // bs].astype(np.int64) * bs + pos % bs
            rows[3, span] = pos + 1
            rows[5, span] = 0
            tables[span, : len(blocks)] = table
        else:
            rows[1, j] = p
            rows[2, j] = blocks[p // bs] * bs + p % bs
            rows[3, j] = p + 1
            tables[j, : len(blocks)] = table
        rows[5, j] = k + 1
        j += k + 1
    return j


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    aux: torch.Tensor | None = None
    """The target's aux hidden states (EAGLE-3) the graph writes, when a draft head reads them."""


class DecodeGraphs:
    """Captured decode steps and their static inputs (ids, positions, slots, context lengths, the
    feed index of async scheduling, block tables)."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        block_size: int,
        prev_tokens: torch.Tensor,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.prev_tokens = prev_tokens
        self.device = device
        self.graphs: dict[int, _Graph] = {}
        self.sizes: list[int] = []
        self.verify_graphs: dict[int, _Graph] = {}
        self.verify_sizes: list[int] = []
        self.max_group = 1
        self._capture_stream: torch.cuda.Stream | None = None
        self._prepared: tuple[int, int, int, int] = (0, 0, 0, 0)
        self.compiled_at_capture = 0
        self._width = 1
        """Block-table columns the staged step uses."""
        self.dp_share: DataParallelShare | None = None
        """Data-parallel attention: this rank's requests, once the KV cache is sized."""
        self._data_parallel = current().dp_attention

    def size_for(self, n: int, verifying: bool = False) -> int | None:
        """The captured size a decode batch (or a verify batch) of `n` rows pads up to; None if
        there is none."""
        for size in self.verify_sizes if verifying else self.sizes:
            if size >= n:
                return size
        return None

    def prepare(
        self, max_batch: int, max_model_len: int, max_rows: int = 0, max_group: int = 1
    ) -> None:
        """The sizes and static inputs of graphs for decode batches up to `max_batch` and, with
        speculation, verify batches up to `max_rows` rows (`verify_graph_sizes`) whose requests
        take up to `max_group` rows each: their decode attention reads a request's context once
        for all its rows. Before `run_dry` and `capture`."""
        self._prepared = (max_batch, max_model_len, max_rows, max_group)
        self.sizes = cuda_graph_sizes(max_batch)
        self.verify_sizes = verify_graph_sizes(max_batch, max_rows) if max_group > 1 else []
        self.max_group = max_group
        max_batch = max([self.sizes[-1], *self.verify_sizes])
        max_blocks = -(-max_model_len // self.block_size)
        dev = self.device
        # One static buffer for the per-row inputs and one for the block tables, each filled from
        # a pinned twin by a single copy per step.
        self._rows = torch.zeros(6, max_batch, dtype=torch.int64, device=dev)
        self._rows[2].fill_(-1)
        self._rows[3].fill_(1)
        self._rows[4].fill_(-1)
        self._rows[5].fill_(1)
        self._ids, self._pos, self._slots, self._lens, self._src, self._groups = self._rows.unbind(
            0
        )
        self._tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=dev)
        self._h_rows = torch.zeros(6, max_batch, dtype=torch.int64, pin_memory=True)
        self._h_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, pin_memory=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        self._qsl = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self._max_len = max_model_len
        # Data-parallel attention: the rows that are not this rank's (dp_attention.localize).
        self._foreign = torch.zeros(max_batch, dtype=torch.bool, device=dev)
        self._h_foreign = torch.zeros(max_batch, dtype=torch.bool, pin_memory=True)

    @torch.inference_mode()
    def capture(
        self,
        kv_cache: torch.Tensor,
        max_batch: int,
        max_model_len: int,
        max_rows: int = 0,
        max_group: int = 1,
    ) -> None:
        """Capture the graphs `prepare` sized (it is called here unless it was, with these
        arguments). Their Triton variants were compiled ahead where the start-up compile ran
        `run_dry`; any it missed are compiled here, in parallel, before the first capture."""
        if self._prepared != (max_batch, max_model_len, max_rows, max_group):
            self.prepare(max_batch, max_model_len, max_rows, max_group)
        with one_layer_of_each_kind(self.model):
            done = precompile(lambda: self.run_dry(kv_cache))
        self.compiled_at_capture = done.variants
        if done.variants:
            log.info(
                "decode graphs: %d Triton kernel variants run dry (%.1f s, compiling in parallel "
                "as they were met), all compiled or loaded %.1f s later",
                done.variants,
                done.dry_s,
                done.compile_s,
            )
        pool = torch.cuda.graph_pool_handle()
        # A capture records from a side stream (as torch.cuda.graph does), after one release of
        # the cached memory for all graphs: the first capture's pool serves the rest.
        self._capture_stream = torch.cuda.Stream(self.device)
        torch.cuda.empty_cache()
        clock = StartupClock()  # seconds by part: each graph's eager run, and its capture
        t0 = time.perf_counter()
        for grouped, sizes, graphs in (
            (True, self.verify_sizes, self.verify_graphs),
            (False, self.sizes, self.graphs),
        ):
            for i, size in enumerate(reversed(sizes)):
                graphs[size] = self._capture(size, grouped, kv_cache, pool, clock, eager=i == 0)
        torch.cuda.synchronize()
        log.info(
            "captured %d CUDA graphs for decode batches up to %d rows and %d for verify batches "
            "in %.1f s (%s)",
            len(self.graphs),
            self.sizes[-1],
            len(self.verify_graphs),
            time.perf_counter() - t0,
            ", ".join(f"{part} {s:.2f} s" for part, s in clock.phases.items()),
        )

    def run_dry(self, kv_cache: torch.Tensor) -> None:
        """The forward of every captured size, for precompile(): each variant any graph launches
        is compiled and loaded before the first capture, so no graph needs a run of its own
        before it is captured (a dry forward, one layer of each kind, costs about a millisecond
        of host time). Any KV cache of the engine's layout will do (a dry run reads none of it)."""
        for grouped, sizes in ((True, self.verify_sizes), (False, self.sizes)):
            for size in sizes:
                self._forward(size, self._context(size, grouped, kv_cache))

    def _capture(
        self,
        size: int,
        grouped: bool,
        kv_cache: torch.Tensor,
        pool: object,
        clock: StartupClock,
        eager: bool,
    ) -> _Graph:
        ctx = self._context(size, grouped, kv_cache)
        if eager:
            # One run outside the first capture of a kind: lazy set-up (cuBLAS's handles, the
            # allocator's first blocks) must not happen inside it. The Triton variants of every
            # size were compiled and loaded by the dry run (a first launch loading a binary
            # inside a capture would fail); a run before each capture cost ~25 ms a graph, ~0.9 s
            # of a start (35 graphs, H100).
            self._forward(size, ctx)
            torch.cuda.synchronize()
            clock.mark("eager runs")
        graph = torch.cuda.CUDAGraph()
        # Not `with torch.cuda.graph(...)`: that releases the allocator's cached device and pinned
        # host memory before every capture (empty_cache), so each of the next graph's eager run
        # and capture allocates it again from the driver. The graphs share one pool and are
        # captured largest first, so the first capture's memory serves every later one.
        with torch.cuda.stream(self._capture_stream):
            graph.capture_begin(pool=pool, capture_error_mode=CAPTURE_MODE)
            try:
                logits = self._forward(size, ctx)
            finally:
                graph.capture_end()
        clock.mark("captures")
        return _Graph(graph, logits, getattr(self.model.model, "aux_hidden", None))

    def _forward(self, size: int, ctx: ForwardContext) -> torch.Tensor:
        ids = feed_input_ids(self._ids[:size], self._src[:size], self.prev_tokens)
        return self.model.compute_logits(self.model(ids, self._pos[:size], ctx))

    def _context(self, size: int, grouped: bool, kv_cache: torch.Tensor) -> ForwardContext:
        foreign = self._foreign[:size] if self._data_parallel else None
        md = self._metadata(size, grouped)
        return ForwardContext(md, kv_cache, self.backend, dp_foreign=foreign)

    def _metadata(self, size: int, grouped: bool) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self._qsl[: size + 1],
            seq_lens=self._lens[:size],
            block_tables=self._tables[:size],
            slot_mapping=self._slots[:size],
            max_query_len=1,
            max_seq_len=self._max_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,
            num_decodes=size,
            decode_groups=self._groups[:size] if grouped else None,
            max_decode_group=self.max_group if grouped else 1,
        )

    def stage(
        self, so: SchedulerOutput, order: list[int], size: int, prev_rows: dict[str, int]
    ) -> int:
        """Write the decode batch `order` of `so` (its verifications as one row per position),
        padded to `size`, into the pinned staging buffers `launch` copies from; returns its rows."""
        # The pinned staging buffers are reused every step: wait until their last copy is done
        # (normally long done: it was queued before the previous step's graph).
        self._staged.synchronize()
        rows = self._h_rows.numpy()
        tables = self._h_tables.numpy()
        n = fill_rows(rows, tables, so, order, prev_rows, self.block_size)
        # Padding rows write nowhere (slot -1) and attend to one harmless slot.
        rows[0, n:size] = 0
        rows[1, n:size] = 0
        rows[2, n:size] = -1
        rows[3, n:size] = 1
        rows[4, n:size] = -1
        rows[5, n:size] = 1
        tables[n:size, 0] = 0
        self._width = max([1, *(len(b) for b in so.block_ids)])
        return n

    def staged(self, size: int, verifying: bool, with_buffers: bool) -> GraphInputs:
        """The staged step as a plan's graph part; `with_buffers`: its staging buffers' used
        part too (for the other ranks of a tensor-parallel engine, `stage_from`)."""
        if not with_buffers:
            return GraphInputs(size, verifying, b"", b"", 0)
        w = self._width
        return GraphInputs(
            size,
            verifying,
            self._h_rows.numpy()[:, :size].tobytes(),
            self._h_tables.numpy()[:size, :w].tobytes(),
            w,
        )

    def stage_from(self, g: GraphInputs) -> None:
        """Another rank's staged step (`staged`) into this rank's staging buffers."""
        self._staged.synchronize()
        self._h_rows.numpy()[:, : g.size] = np.frombuffer(g.rows, np.int64).reshape(6, g.size)
        tables = np.frombuffer(g.tables, np.int32).reshape(g.size, g.width)
        self._h_tables.numpy()[: g.size, : g.width] = tables
        self._width = g.width

    def localize(self, used: int, size: int) -> None:
        """Data-parallel attention: the staged step (after `staged` took the whole of it for
        the other ranks) made this rank's (ember/engine/dp_attention.py)."""
        assert self.dp_share is not None
        foreign = self.dp_share.localize(
            self._h_rows.numpy(), self._h_tables.numpy(), used, size, self._width
        )
        self._h_foreign.numpy()[:size] = foreign

    def launch(self, size: int, verifying: bool = False) -> torch.Tensor:
        """Replay the graph of `size` (a verify graph if `verifying`) on the staged rows; returns
        the graph's logits, one row per position."""
        self._rows.copy_(self._h_rows, non_blocking=True)
        self._tables[:size].copy_(self._h_tables[:size], non_blocking=True)
        if self._data_parallel:
            self._foreign[:size].copy_(self._h_foreign[:size], non_blocking=True)
        self._staged.record()
        g = (self.verify_graphs if verifying else self.graphs)[size]
        g.graph.replay()
        if g.aux is not None:
            self.model.model.aux_hidden = g.aux
        return g.logits
