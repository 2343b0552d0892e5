"""Turns a scheduled batch into one forward pass: flat inputs, paged-attention metadata, logits for
the rows that sample, the sampler, and the scores of the prompt positions a request asked for. Owns
the model, the KV cache tensor and, on a GPU, the CUDA graphs that replay decode steps without
per-kernel launch cost.

A step is launched (`launch`) and collected (`finish`) separately, so the engine can schedule and
launch the next step while this one runs; the tokens it samples stay on the GPU for the next step's
inputs (`prev_tokens`) and travel to the host in one asynchronous copy."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ember.attention.backend import AttentionBackend
from ember.attention.context import ForwardContext
from ember.attention.metadata import AttentionMetadata
from ember.distributed import comm
from ember.engine.cuda_graphs import DecodeGraphs, feed_input_ids, feed_row
from ember.engine.dp_attention import DataParallelShare
from ember.engine.eagle3_step import draft_after_step
from ember.engine.piecewise_graphs import PiecewiseGraphs
from ember.engine.prompt_logprobs import PromptScoring, plan_prompt_scoring
from ember.engine.sampler import Sampler, SamplerOutput, score_tokens
from ember.engine.sampling_rows import sample_rows
from ember.engine.step_plan import EagerInputs, StepPlan
from ember.engine.warmup import blocks_of, dummy_inputs, layers_of_each_kind, profile_runs
from ember.models.config import kv_cache_shape
from ember.spec_decode.verify import last_rows, num_accepted, verify_rows

if TYPE_CHECKING:
    from torch import nn

    from ember.engine.messages import TokenLogprobs
    from ember.engine.request import Request
    from ember.engine.scheduler import SchedulerOutput
    from ember.models.config import ModelConfig
    from ember.spec_decode.eagle3 import Eagle3Drafter

log = logging.getLogger(__name__)

Allocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
"""Where the KV cache's memory comes from: (shape, dtype, device) -> a zeroed tensor."""

PROFILED_LAYERS_OF_EACH_KIND = 2
"""The KV sizing's profiled step runs this many decoder layers of each kind, not all: every later
layer of a kind allocates and frees as the second does (the first meets no residual yet), so the
step's peak is the whole stack's, for a fraction of its GPU time (the 8B shape's 16,384-token
step: 0.05 s against 0.49-0.51 s on an H200, the same peak to the byte; on the tiny models within
the allocator's rounding, tests/engine/test_warmup.py)."""


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: list[int | None]
    """Parallel to the scheduled requests; None for a prefill chunk that does not sample."""
    logprobs: list[list[TokenLogprobs] | None]
    """Per request, one entry per token it got (its accepted drafts, then `sampled`): (token id,
    logprob, rank), the token first, then the top alternatives."""
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]] | None] = field(default_factory=list)
    """Parallel to the scheduled requests: (first position, one entry per position) for a request
    whose prompt positions this step scored, else None."""
    accepted: list[list[int]] = field(default_factory=list)
    """Parallel to the scheduled requests: the draft tokens the step accepted (speculative
    decoding), which come before `sampled`; empty for most."""
    drafts: list[list[int]] = field(default_factory=list)
    """With a draft head (EAGLE-3): the drafts for each request's next step."""


@dataclass(slots=True)
class DriverStep:
    """Rank 0's view of a planned step: the batch and the requests behind its sampling rows."""

    so: SchedulerOutput
    order: list[int]
    ends: list[int]
    index: list[int]
    """Batch position of each sampling request."""
    reqs: list[Request]
    drafts: list[list[int]]
    prompt: PromptScoring | None


@dataclass(slots=True)
class PendingStep:
    """A launched step: its sampled tokens (and logprobs) are being copied to host memory."""

    num_requests: int
    index: list[int]
    """Batch position of each sampling request."""
    num_logprobs: list[int | None]
    tokens: torch.Tensor | None
    logprobs: torch.Tensor | None = None
    logprob_ids: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    prompt: PromptScoring | None = None
    prompt_scores: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """The prompt rows' logprobs, token ids and ranks (`score_tokens`), on their way to the host."""
    done: torch.cuda.Event | None = None
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    launched_at: float = 0.0
    """time.perf_counter() when the step began to launch."""
    drafts: list[list[int]] = field(default_factory=list)
    """Per sampling request (as `index`): the drafts it verifies; its k + 1 sampling rows follow
    one another in `tokens`. Empty when the step verifies none."""
    so: SchedulerOutput | None = None
    """The step's batch, with a draft head: its positions extend the head's KV after the step."""
    aux: torch.Tensor | None = None
    """With a draft head: the target's aux hidden states of every position, in `flat` order."""
    flat: list[int] = field(default_factory=list)
    """With a draft head: where each request's positions start in `aux` (by batch index)."""


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
        max_num_seqs: int = 256,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.backend = backend
        self.kv_dtype = kv_dtype or dtype
        """What the KV cache stores: the model's dtype, or FP8 (attention reads it back)."""
        self.kv_cache = torch.empty(0, device=device)
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)
        self.sampler = Sampler()
        self.prev_tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        """The last launched step's sampled tokens, in its sampling-row order."""
        self._prev_rows: dict[str, int] = {}
        self.graphs = DecodeGraphs(model, backend, block_size, self.prev_tokens, device)
        self.piecewise = PiecewiseGraphs(model, backend, device)
        """Steps with prompt tokens, up to a size: graphs of everything but attention."""
        self.sync_wait_s = 0.0
        """Wall time spent blocked on the GPU (the host's idle share of each step)."""
        self.gpu_timing = False
        """Benchmarks: time each step's forward pass on the GPU with events (last_forward_ms)."""
        self.last_forward_ms = 0.0
        self._cuda = device.type == "cuda"
        self.drafter: Eagle3Drafter | None = None
        """EAGLE-3: drafts from the target's hidden states after each step (ember/spec_decode/eagle3)."""
        self.num_draft_tokens = 0
        """K: the drafts the head chains per request and step."""
        self.activation_peak_bytes = 0
        """The KV sizing's profiled step: bytes beyond the weights (ember/engine/memory.py)."""
        self.send_plan: Callable[[StepPlan], None] | None = None
        """On a tensor-parallel engine's rank 0: hands each step's plan to the other ranks."""
        self.dp_share: DataParallelShare | None = None
        """Data-parallel attention: the requests this rank attends to (its blocks);
        `share_requests` sets it."""

    def share_requests(self, share: DataParallelShare) -> None:
        """Data-parallel attention: this rank attends to the requests whose blocks `share`
        gives it, in its eager steps and its decode graphs."""
        self.dp_share = self.graphs.dp_share = share

    def allocate_kv_cache(self, num_blocks: int, allocate: Allocator | None = None) -> None:
        """`allocate(shape, dtype, device)`: where the cache's memory comes from (a KV
        transport's, for peers to read); zeroed memory of the device otherwise."""
        shape = kv_cache_shape(self.config, num_blocks, self.block_size)
        if allocate is None:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        else:
            self.kv_cache = allocate(shape, self.kv_dtype, self.device)

    # -- inputs ----------------------------------------------------------------------------

    def _tensor(self, data: list[int], dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self._cuda)
        return t.to(self.device, non_blocking=True)

    def prepare(
        self, so: SchedulerOutput, order: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat inputs for the requests in `order` (decodes first, as the attention backend wants)."""
        return self.tensors(self.eager_inputs(so, order))

    def eager_inputs(self, so: SchedulerOutput, order: list[int]) -> EagerInputs:
        """The host's part of `prepare`: the step's flat inputs and metadata as lists."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        fed: list[int] = []  # flat positions whose token the previous step sampled on the GPU
        fed_from: list[int] = []
        for i in order:
            req, n, blocks = so.requests[i], so.num_scheduled_tokens[i], so.block_ids[i]
            start = so.num_computed_tokens[i]
            known = req.all_token_ids[start : start + n]
            if so.spec_token_ids and so.spec_token_ids[i]:
                known = known + so.spec_token_ids[i]  # verified after the last known token
            input_ids.extend(known)
            if len(known) < n:
                if len(known) != n - 1:
                    raise RuntimeError(f"request {req.request_id}: more than one token in flight")
                fed.append(len(input_ids))
                fed_from.append(feed_row(self._prev_rows, req.request_id))
                input_ids.append(0)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            tables.append(blocks)
        return EagerInputs(
            input_ids=input_ids,
            positions=positions,
            slots=slots,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables,
            max_query_len=max(so.num_scheduled_tokens),
            num_decodes=sum(so.num_scheduled_tokens[i] == 1 for i in order),
            fed=fed,
            fed_from=fed_from,
        )

    def tensors(self, e: EagerInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The device's part of `prepare`: input ids, positions and attention metadata."""
        return self._ids(e), self._tensor(e.positions, torch.int64), self._metadata(e)

    def forward_context(self, e: EagerInputs) -> ForwardContext:
        """What the forward pass of a step's eager inputs hands down: its attention metadata,
        or with data-parallel attention this rank's requests' and their rows."""
        if self.dp_share is None:
            return ForwardContext(self._metadata(e), self.kv_cache, self.backend)
        own, rows = self.dp_share.own_rows(e)
        md = self._metadata(own) if rows else self._metadata(e)  # none of its own: not read
        return ForwardContext(
            md, self.kv_cache, self.backend, dp_rows=self._tensor(rows, torch.int64)
        )

    def _metadata(self, e: EagerInputs) -> AttentionMetadata:
        width = max(len(b) for b in e.block_tables)
        flat = [b + [0] * (width - len(b)) for b in e.block_tables]
        return AttentionMetadata(
            query_start_loc=self._tensor(e.query_start_loc, torch.int32),
            seq_lens=self._tensor(e.seq_lens, torch.int32),
            block_tables=self._tensor(flat, torch.int32),
            slot_mapping=self._tensor(e.slots, torch.int64),
            max_query_len=e.max_query_len,
            max_seq_len=max(e.seq_lens),
            query_start_loc_cpu=e.query_start_loc,
            seq_lens_cpu=e.seq_lens,
            num_decodes=e.num_decodes,
        )

    def _ids(self, e: EagerInputs) -> torch.Tensor:
        ids = self._tensor(e.input_ids, torch.int64)
        if e.fed:
            src = [-1] * len(e.input_ids)
            for dst, row in zip(e.fed, e.fed_from, strict=True):
                src[dst] = row
            ids = feed_input_ids(ids, self._tensor(src, torch.int64), self.prev_tokens)
        return ids

    # -- one step ------------------------------------------------------------------------------

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens."""
        return self.finish(self.launch(so))

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> PendingStep:
        """Queue one step's forward pass and sampling on the device; returns without waiting.
        On a tensor-parallel engine the step's plan goes to the other ranks first
        (`send_plan`), which run it beside this one."""
        launched_at = time.perf_counter()
        plan, driver = self.plan(so)
        if self.send_plan is not None:
            self.send_plan(plan)
        return self.run(plan, driver, launched_at)

    def plan(self, so: SchedulerOutput) -> tuple[StepPlan, DriverStep]:
        """Decide a step on the host: the rows, the graph or the eager inputs, what samples and
        what is scored (the plan every rank runs), and the requests behind them (this rank's)."""
        n = len(so.requests)
        # Decode rows first: the attention backend runs them through the decode kernel.
        order = sorted(range(n), key=lambda i: so.num_scheduled_tokens[i] != 1)
        rows = [j for j, i in enumerate(order) if so.samples[i]]
        prompt = plan_prompt_scoring(so, order) if so.scores_prompts else None
        # Decodes and verifications (1 + k tokens for k drafts) replay the decode graphs.
        spec = so.spec_token_ids or [[]] * n
        all_decode = prompt is None and all(
            k == 1 + len(d) for k, d in zip(so.num_scheduled_tokens, spec, strict=True)
        )
        num_rows = so.total_num_scheduled_tokens
        verifying = any(spec)
        graph_bs = (
            self.graphs.size_for(num_rows, verifying) if all_decode and self.graphs.graphs else None
        )
        # Where each request's tokens end in the step's flat layout (a graph's rows are that
        # layout too), and the positions whose logits sample: a sampling request's last one, or
        # with k drafts its last k + 1 (every verified position samples).
        ends = list(itertools.accumulate(so.num_scheduled_tokens[i] for i in order))
        drafts = [spec[order[j]] for j in rows]
        if not any(drafts):
            drafts = []
        sample_ends = [ends[j] for j in rows]
        sample_at = verify_rows(sample_ends, drafts) if drafts else [e - 1 for e in sample_ends]
        plan = StepPlan(n, sample_at, num_sampling=len(rows))
        if graph_bs is not None:
            self.graphs.stage(so, order, graph_bs, self._prev_rows)
            plan.graph = self.graphs.staged(graph_bs, verifying, self.send_plan is not None)
            plan.num_rows = num_rows
        else:
            plan.eager = self.eager_inputs(so, order)
        if prompt is not None:
            plan.score_rows, plan.score_targets = prompt.rows, prompt.targets
            plan.score_want = max(span[3] for span in prompt.spans)
        if drafts:
            plan.last_rows = last_rows(drafts)
        reqs = [so.requests[order[j]] for j in rows]
        # The next step feeds each request's token from the row this step samples it in.
        self._prev_rows = {r.request_id: j for j, r in enumerate(reqs)}
        driver = DriverStep(so, order, ends, [order[j] for j in rows], reqs, drafts, prompt)
        return plan, driver

    @torch.inference_mode()
    def run(
        self, plan: StepPlan, driver: DriverStep | None, launched_at: float = 0.0
    ) -> PendingStep:
        """Queue a planned step on this rank's device. `driver`: rank 0's view of the step (its
        requests, which sample); None on the other ranks, which run the same forward pass and
        collectives and take rank 0's sampled tokens."""
        timing = self._timing_events() if self.gpu_timing else None
        if timing is not None:
            timing[0].record()
        scores = None
        if plan.graph is not None:
            if driver is None:
                self.graphs.stage_from(plan.graph)
            if self.dp_share is not None:
                self.graphs.localize(plan.num_rows, plan.graph.size)
            logits = self.graphs.launch(plan.graph.size, plan.graph.verifying)
            if len(plan.sample_at) == plan.num_rows:  # every row samples: a slice, no index
                logits = logits[: plan.num_rows]
            else:  # a one-token prompt chunk that does not end its prompt samples nothing
                logits = logits[self._tensor(plan.sample_at, torch.int64)]
        else:
            assert plan.eager is not None
            e = plan.eager
            ids, positions = self._ids(e), self._tensor(e.positions, torch.int64)
            size = self.piecewise.size_for(ids.shape[0])
            if size is not None:
                hidden = self.piecewise.run(ids, positions, self._metadata(e), size)
            else:
                hidden = self.model(ids, positions, self.forward_context(e))
            if plan.score_rows:
                scores = self._score_prompt(
                    hidden, plan.score_rows, plan.score_targets, plan.score_want
                )
            if not plan.sample_at:
                prompt = driver.prompt if driver is not None else None
                step = PendingStep(plan.num_requests, [], [], None, prompt=prompt)
                step.prompt_scores = scores if driver is not None else None
                step.launched_at = launched_at
                if driver is not None:
                    self._keep_aux(step, driver.so, driver.order, driver.ends)
                return self._queued(step)
            logits = self.model.compute_logits(hidden[self._tensor(plan.sample_at, torch.int64)])
        if timing is not None:
            timing[1].record()
        out = None
        if driver is not None:
            out = self._sample(logits, driver.reqs, driver.drafts)
            sampled = out.sampled
        else:
            sampled = torch.empty(len(plan.sample_at), dtype=torch.int64, device=self.device)
        # Every rank feeds the next step the tokens rank 0 sampled (its sampler alone sees the
        # requests' parameters, grammars and generators).
        comm.broadcast(sampled, src=0)
        if plan.last_rows:  # the next step may feed each request's last row
            self.prev_tokens[: plan.num_sampling].copy_(
                sampled[self._tensor(plan.last_rows, torch.int64)]
            )
        else:
            self.prev_tokens[: plan.num_sampling].copy_(sampled)
        if driver is None or out is None:
            return PendingStep(plan.num_requests, [], [], None)
        step = PendingStep(
            plan.num_requests,
            driver.index,
            [r.sampling_params.logprobs for r in driver.reqs],
            self._to_host(out.sampled),
            self._to_host(out.logprobs),
            self._to_host(out.logprob_token_ids),
            self._to_host(out.sampled_ranks),
            prompt=driver.prompt,
            prompt_scores=scores,
            timing=timing,
            launched_at=launched_at,
            drafts=driver.drafts,
        )
        self._keep_aux(step, driver.so, driver.order, driver.ends)
        return self._queued(step)

    def _keep_aux(
        self, step: PendingStep, so: SchedulerOutput, order: list[int], ends: list[int]
    ) -> None:
        """With a draft head: the step's aux hidden states, for `draft` once tokens are known,
        and where each request's positions start among them."""
        if self.drafter is None:
            return
        step.so, step.aux = so, self.model.model.aux_hidden
        step.flat = [0] * len(so.requests)
        for i, end in zip(order, ends, strict=True):
            step.flat[i] = end - so.num_scheduled_tokens[i]

    def _queued(self, step: PendingStep) -> PendingStep:
        """Mark the end of a step's device work, which its host copies wait for."""
        if self._cuda and (step.tokens is not None or step.prompt_scores is not None):
            step.done = torch.cuda.Event()
            step.done.record()
        return step

    def finish(self, step: PendingStep) -> ModelRunnerOutput:
        """Wait for a launched step's tokens (the step's one host sync) and hand them out."""
        sampled: list[int | None] = [None] * step.num_requests
        logprobs: list[TokenLogprobs | None] = [None] * step.num_requests
        prompt_logprobs: list[tuple[int, list[TokenLogprobs]] | None] = [None] * step.num_requests
        result = ModelRunnerOutput(sampled, logprobs, prompt_logprobs)
        if step.tokens is None and step.prompt_scores is None:
            return result
        if step.done is not None:
            t0 = time.perf_counter()
            step.done.synchronize()
            self.sync_wait_s += time.perf_counter() - t0
        if step.timing is not None:
            self.last_forward_ms = step.timing[0].elapsed_time(step.timing[1])
        if step.prompt is not None and step.prompt_scores is not None:
            lp, lp_ids, ranks = (t.tolist() for t in step.prompt_scores)
            row = 0
            for i, first, count, want in step.prompt.spans:
                prompt_logprobs[i] = (
                    first,
                    [_entries(lp_ids[r], lp[r], ranks[r], want) for r in range(row, row + count)],
                )
                row += count
        if step.tokens is None:
            return result
        tokens = step.tokens.tolist()
        lp = step.logprobs.tolist() if step.logprobs is not None else None
        lp_ids = step.logprob_ids.tolist() if step.logprob_ids is not None else None
        ranks = step.ranks.tolist() if step.ranks is not None else None
        accepted: list[list[int]] = [[] for _ in range(step.num_requests)]
        result.accepted = accepted
        row = 0
        for j, i in enumerate(step.index):
            drafts = step.drafts[j] if step.drafts else []
            n = num_accepted(tokens[row : row + len(drafts) + 1], drafts)
            accepted[i] = drafts[:n]
            sampled[i] = tokens[row + n]
            want = step.num_logprobs[j]
            if want is not None and lp is not None and lp_ids is not None and ranks is not None:
                logprobs[i] = [
                    _entries(lp_ids[r], lp[r], ranks[r], want) for r in range(row, row + n + 1)
                ]
            row += len(drafts) + 1
        if self.drafter is not None:
            result.drafts = self._draft(step, result)
        return result

    def _draft(self, step: PendingStep, result: ModelRunnerOutput) -> list[list[int]]:
        """EAGLE-3 after a step (`ember.engine.eagle3_step`): the head's KV grows by the step's
        accepted positions, and the speculating requests get their next drafts."""
        if step.so is None or step.aux is None or self.drafter is None:
            return [[] for _ in range(step.num_requests)]
        return draft_after_step(
            self.drafter,
            self.num_draft_tokens,
            self.block_size,
            step.so,
            step.aux,
            step.flat,
            result.sampled,
            result.accepted,
        )

    def _score_prompt(
        self, hidden: torch.Tensor, rows: list[int], targets: list[int], want: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Only the asking requests' rows pay for logits and a float32 log-softmax."""
        scores = score_tokens(
            hidden[self._tensor(rows, torch.int64)],
            self._tensor(targets, torch.int64),
            want,
            self.model.compute_logits,
            self.config.vocab_size,
        )
        lp, ids, ranks = (self._copy_to_host(t) for t in scores)
        return lp, ids, ranks

    def _sample(
        self, logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]]
    ) -> SamplerOutput:
        """The step's sampling rows (`ember.engine.sampling_rows`); a method, so that a profile
        can time it on one runner."""
        return sample_rows(self.sampler, logits, reqs, drafts, self.device)

    def _to_host(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else self._copy_to_host(t)

    def _copy_to_host(self, t: torch.Tensor) -> torch.Tensor:
        """An asynchronous copy into pinned memory; read it only after the step's event."""
        if not self._cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    def _timing_events(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        if not self._cuda:
            return None
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    # -- CUDA graphs -----------------------------------------------------------------------------

    def capture_cuda_graphs(
        self,
        max_batch: int,
        max_model_len: int,
        max_rows: int = 0,
        max_group: int = 1,
        piecewise_tokens: int = 0,
    ) -> None:
        """Capture one decode graph per batch size; replays pad a batch up to the next size.
        `max_rows`: verify batches (speculation) of up to that many rows, `max_group` (k + 1) a
        request, get graphs too. `piecewise_tokens`: steps with prompt tokens of up to that many
        tokens in all replay piecewise graphs (ember/engine/piecewise_graphs.py)."""
        if self._cuda:
            self.graphs.capture(
                self.kv_cache,
                min(max_batch, len(self.prev_tokens)),
                max_model_len,
                max_rows,
                max_group,
            )
            self.piecewise.capture(self.kv_cache, piecewise_tokens, self.config.num_hidden_layers)

    def prepare_cuda_graphs(
        self,
        max_batch: int,
        max_model_len: int,
        max_rows: int = 0,
        max_group: int = 1,
        piecewise_tokens: int = 0,
    ) -> Callable[[], None] | None:
        """Size the graphs `capture_cuda_graphs` will capture (the same arguments), and return
        their dry run over the current (temporary) KV cache for the start-up compile: so their
        Triton variants compile with the rest, in parallel. None on the CPU."""
        if not self._cuda:
            return None
        self.graphs.prepare(
            min(max_batch, len(self.prev_tokens)), max_model_len, max_rows, max_group
        )
        self.piecewise.prepare(piecewise_tokens)

        def run_dry() -> None:
            self.graphs.run_dry(self.kv_cache)
            self.piecewise.run_dry(self.kv_cache)

        return run_dry

    # -- memory ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def profile_peak_bytes(self, num_tokens: int, max_model_len: int, max_seqs: int) -> int:
        """Peak bytes a worst-case step takes beyond the weights (activations, logits, sampler),
        measured on the first two decoder layers of each kind (PROFILED_LAYERS_OF_EACH_KIND)."""
        runs = profile_runs(num_tokens, max_model_len, max_seqs)
        saved = self.kv_cache
        self.allocate_kv_cache(blocks_of(runs, self.block_size))
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        ids, pos, md = dummy_inputs(self, runs)
        # EAGLE-3's hidden states are taken from given layers of the whole stack: all of it runs.
        aux = getattr(getattr(self.model, "model", None), "aux_layers", ())
        cut = (
            contextlib.nullcontext()
            if aux
            else layers_of_each_kind(self.model, PROFILED_LAYERS_OF_EACH_KIND)
        )
        with cut:
            hidden = self.model(ids, pos, ForwardContext(md, self.kv_cache, self.backend))
        logits = self.model.compute_logits(hidden[: min(max_seqs, num_tokens)])
        torch.softmax(logits, dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del hidden, logits
        self.kv_cache = saved
        torch.cuda.empty_cache()
        return peak


def _entries(ids: list[int], logprobs: list[float], rank: int, want: int) -> TokenLogprobs:
    """One position's (token id, logprob, rank): its token first, then `want` alternatives."""
    return [(ids[0], logprobs[0], rank)] + [(ids[k], logprobs[k], k) for k in range(1, want + 1)]
