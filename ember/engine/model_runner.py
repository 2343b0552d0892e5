"""Turns a scheduled batch into one forward pass: flat inputs, paged-attention metadata, logits for
the rows that sample, and the sampler. Owns the model, the KV cache tensor and, on a GPU, the CUDA
graphs that replay decode steps without per-kernel launch cost."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ember.attention.backend import AttentionBackend
from ember.attention.metadata import AttentionMetadata, ForwardContext
from ember.engine.sampler import Sampler, SamplingBatch
from ember.engine.structured_output import apply_grammar_masks

if TYPE_CHECKING:
    from torch import nn

    from ember.engine.request import Request
    from ember.engine.scheduler import SchedulerOutput
    from ember.models.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: list[int | None]
    """Parallel to the scheduled requests; None for a prefill chunk that does not sample."""
    logprobs: list[list[tuple[int, float, int]] | None]
    """Per row: (token id, logprob, rank), the sampled token first, then the top alternatives."""


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (num_blocks, cfg.num_hidden_layers, 2, block_size, cfg.num_key_value_heads, cfg.head_dim)


def cuda_graph_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every 8 (a decode batch pads up to the next one)."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend,
        num_blocks: int | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.backend = backend
        self.kv_cache = torch.empty(0, device=device)
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)
        self.sampler = Sampler()
        self.graphs: dict[int, _Graph] = {}
        self.sync_wait_s = 0.0
        """Wall time spent blocked on the GPU (the host's idle share of each step)."""
        self.gpu_timing = False
        """Benchmarks: time each step's forward pass on the GPU with events (last_forward_ms)."""
        self.last_forward_ms = 0.0
        self._events = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if device.type == "cuda"
            else ()
        )
        self._pin = device.type == "cuda"

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = kv_cache_shape(self.config, num_blocks, self.block_size)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    # -- inputs ----------------------------------------------------------------------------

    def _tensor(self, data: list[int], dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self._pin)
        return t.to(self.device, non_blocking=True)

    def prepare(
        self, so: SchedulerOutput, order: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat inputs for the requests in `order` (decodes first, as the attention backend wants)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for i in order:
            req, n, blocks = so.requests[i], so.num_scheduled_tokens[i], so.block_ids[i]
            start = req.num_computed_tokens
            input_ids.extend(req.all_token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            tables.append(blocks)
        width = max(len(b) for b in tables)
        flat = [b + [0] * (width - len(b)) for b in tables]
        md = AttentionMetadata(
            query_start_loc=self._tensor(qsl, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(flat, torch.int32),
            slot_mapping=self._tensor(slots, torch.int64),
            max_query_len=max(so.num_scheduled_tokens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            num_decodes=sum(so.num_scheduled_tokens[i] == 1 for i in order),
        )
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), md

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        n = len(so.requests)
        # Decode rows first: the attention backend runs them through the decode kernel.
        order = sorted(range(n), key=lambda i: so.num_scheduled_tokens[i] != 1)
        # Only rows whose step reaches the end of their known tokens sample a next token.
        rows = [
            j
            for j, i in enumerate(order)
            if so.requests[i].num_computed_tokens + so.num_scheduled_tokens[i]
            == so.requests[i].num_tokens
        ]
        sampled: list[int | None] = [None] * n
        logprobs: list[list[tuple[int, float, int]] | None] = [None] * n
        all_decode = all(k == 1 for k in so.num_scheduled_tokens)
        graph_bs = self._graph_size(n) if all_decode else None
        if self.gpu_timing:
            self._events[0].record()
        if graph_bs is not None:
            logits = self._replay(so, order, graph_bs)
            # A slice when every row samples; never index with a host list (a hidden sync).
            logits = logits[:n] if len(rows) == n else logits[self._tensor(rows, torch.int64)]
        else:
            ids, positions, md = self.prepare(so, order)
            hidden = self.model(ids, positions, ForwardContext(md, self.kv_cache, self.backend))
            if not rows:
                return ModelRunnerOutput(sampled, logprobs)
            last = self._tensor([md.query_start_loc_cpu[j + 1] - 1 for j in rows], torch.int64)
            logits = self.model.compute_logits(hidden[last])
        if self.gpu_timing:
            self._events[1].record()
        if not rows:
            return ModelRunnerOutput(sampled, logprobs)
        reqs = [so.requests[order[j]] for j in rows]
        self._sample(logits, reqs, [order[j] for j in rows], sampled, logprobs)
        return ModelRunnerOutput(sampled, logprobs)

    def _sample(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        index: list[int],
        sampled: list[int | None],
        logprobs: list[list[tuple[int, float, int]] | None],
    ) -> None:
        if any(r.matcher is not None for r in reqs):
            apply_grammar_masks(logits, [r.matcher for r in reqs])
        batch = SamplingBatch.build(
            params=[r.sampling_params for r in reqs],
            prompt_ids=[r.prompt_token_ids for r in reqs],
            output_ids=[r.output_token_ids for r in reqs],
            generators=[r.generator for r in reqs],
            blocked=[_blocked_tokens(r) for r in reqs],
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        out = self.sampler(logits, batch)
        t0 = time.perf_counter()
        tokens = out.sampled.tolist()  # the step's one host sync
        self.sync_wait_s += time.perf_counter() - t0
        if self.gpu_timing:
            self.last_forward_ms = self._events[0].elapsed_time(self._events[1])
        lp = out.logprobs.tolist() if out.logprobs is not None else None
        lp_ids = out.logprob_token_ids.tolist() if out.logprob_token_ids is not None else None
        ranks = out.sampled_ranks.tolist() if out.sampled_ranks is not None else None
        for j, i in enumerate(index):
            sampled[i] = tokens[j]
            want = reqs[j].sampling_params.logprobs
            if want is not None and lp is not None and lp_ids is not None and ranks is not None:
                entries = [(lp_ids[j][0], lp[j][0], ranks[j])]
                entries += [(lp_ids[j][k], lp[j][k], k) for k in range(1, want + 1)]
                logprobs[i] = entries

    # -- CUDA graphs -----------------------------------------------------------------------------

    def _graph_size(self, n: int) -> int | None:
        if not self.graphs:
            return None
        for size in self._graph_sizes:
            if size >= n:
                return size
        return None

    @torch.inference_mode()
    def capture_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Capture one decode graph per batch size; replays pad a batch up to the next size."""
        if self.device.type != "cuda":
            return
        max_blocks = -(-max_model_len // self.block_size)
        dev = self.device
        # One static buffer for the per-row inputs (ids, positions, slots, context lengths) and
        # one for the block tables, each filled from a pinned twin by a single copy per step.
        self._g_rows = torch.zeros(4, max_batch, dtype=torch.int64, device=dev)
        self._g_rows[2].fill_(-1)
        self._g_rows[3].fill_(1)
        self._g_ids, self._g_pos, self._g_slots, self._g_lens = self._g_rows.unbind(0)
        self._g_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=dev)
        self._h_rows = torch.zeros(4, max_batch, dtype=torch.int64, pin_memory=True)
        self._h_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, pin_memory=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        self._g_qsl = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self._g_max_len = max_model_len
        self._graph_sizes = cuda_graph_sizes(max_batch)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self._graph_sizes):
            md = self._graph_metadata(size)
            ctx = ForwardContext(md, self.kv_cache, self.backend)
            for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
                self.model.compute_logits(self.model(self._g_ids[:size], self._g_pos[:size], ctx))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(self._g_ids[:size], self._g_pos[:size], ctx)
                logits = self.model.compute_logits(hidden)
            self.graphs[size] = _Graph(graph, logits)
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs for decode batches up to %d", len(self.graphs), max_batch)

    def _graph_metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self._g_qsl[: size + 1],
            seq_lens=self._g_lens[:size],
            block_tables=self._g_tables[:size],
            slot_mapping=self._g_slots[:size],
            max_query_len=1,
            max_seq_len=self._g_max_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,
            num_decodes=size,
        )

    def _replay(self, so: SchedulerOutput, order: list[int], size: int) -> torch.Tensor:
        # The pinned staging buffers are reused every step: wait until their last copy is done
        # (normally already true: a step ends by syncing on its sampled tokens).
        self._staged.synchronize()
        rows = self._h_rows.numpy()
        tables = self._h_tables.numpy()
        bs = self.block_size
        for j, i in enumerate(order):
            req, blocks = so.requests[i], so.block_ids[i]
            p = req.num_computed_tokens
            rows[0, j] = req.all_token_ids[p]
            rows[1, j] = p
            rows[2, j] = blocks[p // bs] * bs + p % bs
            rows[3, j] = p + 1
            tables[j, : len(blocks)] = blocks
        n = len(order)
        # Padding rows write nowhere (slot -1) and attend to one harmless slot.
        rows[0, n:size] = 0
        rows[1, n:size] = 0
        rows[2, n:size] = -1
        rows[3, n:size] = 1
        tables[n:size, 0] = 0
        self._g_rows.copy_(self._h_rows, non_blocking=True)
        self._g_tables[:size].copy_(self._h_tables[:size], non_blocking=True)
        self._staged.record()
        g = self.graphs[size]
        g.graph.replay()
        return g.logits

    # -- memory ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def profile_peak_bytes(self, num_tokens: int, max_model_len: int, max_seqs: int) -> int:
        """Peak bytes a worst-case step takes beyond the weights (activations, logits, sampler)."""
        seqs = max(1, min(max_seqs, -(-num_tokens // max_model_len)))
        per_seq = [num_tokens // seqs + (i < num_tokens % seqs) for i in range(seqs)]
        blocks_per_seq = [-(-n // self.block_size) for n in per_seq]
        saved = self.kv_cache
        self.allocate_kv_cache(sum(blocks_per_seq))
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        tables, start = [], 0
        for nb in blocks_per_seq:
            tables.append(list(range(start, start + nb)))
            start += nb
        qsl = [0]
        for n in per_seq:
            qsl.append(qsl[-1] + n)
        slots = [
            t[p // self.block_size] * self.block_size + p % self.block_size
            for t, n in zip(tables, per_seq, strict=True)
            for p in range(n)
        ]
        width = max(blocks_per_seq)
        md = AttentionMetadata(
            query_start_loc=self._tensor(qsl, torch.int32),
            seq_lens=self._tensor(per_seq, torch.int32),
            block_tables=self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
            slot_mapping=self._tensor(slots, torch.int64),
            max_query_len=max(per_seq),
            max_seq_len=max(per_seq),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=per_seq,
        )
        ids = torch.randint(0, self.config.vocab_size, (num_tokens,), device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in per_seq])
        hidden = self.model(ids, pos, ForwardContext(md, self.kv_cache, self.backend))
        logits = self.model.compute_logits(hidden[: min(max_seqs, num_tokens)])
        torch.softmax(logits, dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del hidden, logits
        self.kv_cache = saved
        torch.cuda.empty_cache()
        return peak


def _blocked_tokens(req: Request) -> list[int]:
    """EOS and stop ids may not be sampled before `min_tokens` outputs."""
    params = req.sampling_params
    if req.num_output_tokens >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else req.eos_token_ids
    return sorted(set(eos) | set(params.stop_token_ids or ()))
