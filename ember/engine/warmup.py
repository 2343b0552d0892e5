"""Dummy forward passes: the profiled worst-case step that sizes the KV cache, and the start-up
warm-up that meets the batch shapes serving will meet so that Triton compiles their kernel variants
before the first request rather than during it.

A Triton kernel is compiled once per variant: its constexprs (tile sizes some kernels pick by
token count) and the specializations of its arguments (ember's kernels keep batch-dependent
integers and sliced pointers out of them). The warm-up's batches vary what is left: one token and
many, each tile class, fresh prompts and prompts over a cached prefix, decode rows alone past the
captured graphs and mixed with a prefill chunk. `precompile_start_up` runs them (with the profiled
step) *dry* and compiles every variant they reach in parallel (ember/kernels/precompile.py; the
decode graphs find theirs the same way when captured); `ember/kernels/compile_log.py` names any
variant still compiled on the request path, which is the list to extend.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ember.attention.context import ForwardContext
from ember.attention.metadata import AttentionMetadata
from ember.kernels.precompile import Precompiled, precompile
from ember.kernels.sampling import gumbel_sample
from ember.models.config import kv_cache_shape

if TYPE_CHECKING:
    from ember.kernels.compile_workers import CompileWorkers

log = logging.getLogger(__name__)

Run = tuple[int, int]
"""One sequence of a dummy batch: (new tokens, tokens already in its KV)."""

PROBES = 2
"""The warm-up's first batches: they reach the slowest variants to compile (run them first)."""


def dummy_inputs(
    runner, runs: list[Run], max_seq_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input ids, positions, metadata) of a batch of `runs` over consecutive KV blocks from 0 of
    `runner.kv_cache`; single-token runs are decode rows and must come first, as the scheduler
    orders them. Random token ids; what the blocks held before is overwritten or read as is.
    `max_seq_len`: the bound the decode kernel sizes its splits by (a captured graph's is the
    model's length), the longest run's by default."""
    bs = runner.block_size
    decodes = sum(n == 1 for n, _ in runs)
    if any(n != 1 for n, _ in runs[:decodes]):
        raise ValueError("decode rows (one new token) must come first")
    tables, slots, qsl, seq_lens, positions, start = [], [], [0], [], [], 0
    for n, ctx in runs:
        total = ctx + n
        blocks = list(range(start, start + -(-total // bs)))
        start += len(blocks)
        tables.append(blocks)
        slots += [blocks[p // bs] * bs + p % bs for p in range(ctx, total)]
        positions += range(ctx, total)
        qsl.append(qsl[-1] + n)
        seq_lens.append(total)
    if start > runner.kv_cache.shape[0]:
        raise ValueError(
            f"a dummy batch of {start} blocks in a cache of {runner.kv_cache.shape[0]}"
        )
    width = max(len(t) for t in tables)
    md = AttentionMetadata(
        query_start_loc=runner._tensor(qsl, torch.int32),
        seq_lens=runner._tensor(seq_lens, torch.int32),
        block_tables=runner._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
        slot_mapping=runner._tensor(slots, torch.int64),
        max_query_len=max(n for n, _ in runs),
        max_seq_len=max_seq_len or max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decodes=decodes,
    )
    ids = torch.randint(0, runner.config.vocab_size, (qsl[-1],), device=runner.device)
    pos = torch.tensor(positions, dtype=torch.int64, device=runner.device)
    return ids, pos, md


@torch.inference_mode()
def dummy_step(runner, runs: list[Run], max_seq_len: int | None = None) -> torch.Tensor:
    """One forward pass and the logits of each run's last row: [len(runs), vocab]."""
    ids, pos, md = dummy_inputs(runner, runs, max_seq_len)
    hidden = runner.model(ids, pos, ForwardContext(md, runner.kv_cache, runner.backend))
    last = torch.tensor(md.query_start_loc_cpu[1:], device=runner.device) - 1
    return runner.model.compute_logits(hidden[last])


def _describe(runs: list[Run]) -> str:
    """A dummy batch in a few words: its runs of (new tokens, cached tokens), repeats counted."""
    parts = []
    for run in dict.fromkeys(runs):
        count = runs.count(run)
        parts.append(f"{count} x {run}" if count > 1 else str(run))
    return "[" + ", ".join(parts) + "]"


@torch.inference_mode()
def probe_attention(runner, runs: list[Run]) -> None:
    """The attention of a dummy batch alone, on q, k and v laid out as a layer hands them over
    (q and k out of the rotation, v a view of the fused q/k/v projection) over layer 0's cache:
    a dry run meets the attention kernels' variants (the slowest to compile) first, before any
    layer's GEMMs (each new GEMM shape costs cuBLAS a first-use load of its kernels). Measured on
    an H200, the wait before them was mostly Triton's install key, since computed ahead
    (ember/kernels/triton_setup.py): the probe alone is not separately measured. MLA models call
    their own attention: nothing to probe."""
    cfg = runner.config
    if cfg.uses_mla:
        return
    _, _, md = dummy_inputs(runner, runs)
    t, h, kv, d = md.num_tokens, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    zeros = dict(dtype=runner.dtype, device=runner.device)
    q, k = torch.zeros(t, h, d, **zeros), torch.zeros(t, kv, d, **zeros)
    v = torch.zeros(t, (h + 2 * kv) * d, **zeros)[:, (h + kv) * d :].view(t, kv, d)
    fused = runner.backend.fuses_kv_write
    runner.backend.forward(q, k, v, runner.kv_cache[:, 0], md, d**-0.5, kv_written=fused)


class AttentionOnly:
    """What `probe_attention` (and `dummy_inputs`) use of a model runner, before there is a
    model: the model's shape, the KV layout (one layer's cache: a probe reads only layer 0) and
    the attention backend. The probes then run while the weights are still to load."""

    def __init__(
        self, config, block_size: int, dtype: torch.dtype, device, backend, kv_dtype=None
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.device = torch.device(device)
        self.backend = backend
        self.kv_cache = torch.empty(0, device=self.device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = kv_cache_shape(self.config, num_blocks, self.block_size, layers=1)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _tensor(self, data: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)


def compile_probes_early(
    stand_in: AttentionOnly, probes: list[list[Run]], workers: int | None = None
) -> CompileWorkers | None:
    """Meet the probes' attention variants and the fused sampler's (the slowest compiles of a
    start-up) before the model loads, and start their compiles in forked workers without
    waiting for them: the weights load meanwhile, and `precompile_start_up(..., workers=...)`
    after it takes each of these compiles as its own when its dry run meets the variant again.
    Nothing runs on the GPU (the launches are recorded, not made). None where there is nothing
    to start (no CUDA, no probes, MLA's own attention) or the probes' cache does not fit."""
    if stand_in.device.type != "cuda" or not probes or stand_in.config.uses_mla:
        return None
    from triton.runtime import driver

    from ember.kernels.compile_workers import CompileWorkers
    from ember.kernels.precompile import default_workers, recording

    target = driver.active.get_current_target()
    procs = CompileWorkers(workers or default_workers())
    try:
        stand_in.allocate_kv_cache(max(blocks_of(runs, stand_in.block_size) for runs in probes))
        with recording(on_found=lambda kernel, data: procs.submit(kernel, data, target)):
            for runs in probes:
                probe_attention(stand_in, runs)
            vocab = stand_in.config.vocab_size
            dev = stand_in.device
            gumbel_sample(torch.zeros(2, vocab, device=dev), torch.ones(2, device=dev), 0)
    except torch.OutOfMemoryError as e:  # what was submitted goes on compiling
        log.warning("early start-up compile cut short (the probes' cache does not fit): %s", e)
    except Exception:  # only a head start: the dry run after the load meets every variant
        log.warning("early start-up compile skipped", exc_info=True)
        procs.close()
        return None
    finally:
        stand_in.kv_cache = stand_in.kv_cache.new_empty(0)  # the probes' cache given back
    return procs


def warmup_batches(
    max_tokens: int, max_seqs: int, max_model_len: int, graph_batch: int, block_size: int
) -> list[list[Run]]:
    """The batch shapes the warm-up runs, within the step's token and sequence budgets."""

    def fits(runs: list[Run]) -> bool:
        return (
            len(runs) <= max_seqs
            and sum(n for n, _ in runs) <= max_tokens
            and all(n + c <= max_model_len for n, c in runs)
        )

    ctx = min(4 * block_size + 3, max_model_len // 2)  # a cached prefix, off the block edge
    # Token counts reaching each tile class the kernels choose by count (the prefill kernel's 16
    # to 128 query rows, the norms' row blocks, the fused MoE's three tile shapes: its largest
    # needs more than 64 routed rows an expert); variants do not depend on the count otherwise
    # (batch-dependent ints do not specialize), so no batch needs the full token budget.
    small = {1, 2, 15, 16, 17, 40, 100}
    # First, a decode row beside a fresh prompt and a chunk over a cached prefix, of each
    # prefill tile class (up to 64 query rows and past it): the prefill attention's TMA
    # variants are the slowest to compile (~1.5-2 s each on an H200's host, the start-up's
    # critical path when the dry run met them 1.1-1.6 s in), so their compiles start first,
    # with the eager decode kernels'. Smaller where the step's budgets are.
    batches: list[list[Run]] = []  # (PROBES of them)
    for n in (2, 100):
        n = max(2, min(n, (max_tokens - 1) // 2))
        batches.append([(1, ctx), (n, 0), (n, ctx)])
    for n in sorted(small | {256, 1000, max_tokens // 2 + 1}):
        batches.append([(n, 0)])  # a fresh prompt (or chunk) alone
    for n in sorted(small):
        batches.append([(n, ctx)])  # a chunk over a cached prefix
    batches.append([(100, 0)] * 3)  # several prompts in one step
    for d in sorted({1, 7, 16, graph_batch + 1, max_seqs}):
        batches.append([(1, ctx)] * d)  # decode rows alone (eager past the captured graphs)
        batches.append([(1, ctx)] * d + [(100, 0)])  # mixed with a chunk
        batches.append([(1, ctx)] * d + [(17, ctx)])
    # One decode row over a long context: 2 to 64 splits, each merge tile, eagerly (the graphs'
    # batches reach the tiles too, but their inputs are of other types: other variants).
    for long in (300, 1000, 2000, 4000, 8000, 16000):
        batches.append([(1, min(long, max_model_len - 1))])
    seen, kept = set(), []
    for b in batches:
        b = [(min(n, max_model_len), c) for n, c in b]
        key = tuple(b)
        if key not in seen and fits(b):
            seen.add(key)
            kept.append(b)
    return kept


def one_layer_of_each_kind(model) -> contextlib.AbstractContextManager:
    """The model's decoder with one layer of each kind (a dry run's cut), where it knows how."""
    return layers_of_each_kind(model, 1)


def layers_of_each_kind(model, per_kind: int) -> contextlib.AbstractContextManager:
    """The model's decoder with its first `per_kind` layers of each kind, where it knows how."""
    decoder = getattr(model, "model", None)
    cut = getattr(decoder, "layers_of_each_kind", None)
    return cut(per_kind) if cut is not None else contextlib.nullcontext()


def profile_runs(num_tokens: int, max_model_len: int, max_seqs: int) -> list[Run]:
    """The worst-case step the KV sizing profiles: the step's whole token budget as fresh prompts,
    as few as the model's length allows."""
    seqs = max(1, min(max_seqs, -(-num_tokens // max_model_len)))
    return [(num_tokens // seqs + (i < num_tokens % seqs), 0) for i in range(seqs)]


def blocks_of(runs: list[Run], block_size: int) -> int:
    """KV blocks a dummy batch of `runs` takes (dummy_inputs gives each run its own)."""
    return sum(-(-(n + c) // block_size) for n, c in runs)


def precompile_start_up(
    runner,
    batches: list[list[Run]],
    graphs_dry: Callable[[], None] | None = None,
    graphs_after: int = 0,
    workers: CompileWorkers | None = None,
) -> Precompiled | None:
    """Run `batches` dry over a temporary KV cache and compile every Triton variant they reach in
    parallel (None: there was nothing to run). `graphs_dry`: the CUDA graphs' dry run
    (`ModelRunner.prepare_cuda_graphs`), run after the first `graphs_after` batches, whose
    variants (the graphs' own input buffers) compile in the same pool. `workers`: the compile
    workers `compile_probes_early` started before the model loaded (closed here either way).

    Where the time goes (H200, 8B shape): the graphs' sizes take most of a dry run (1.4-1.7 of
    1.6-1.9 s: each size is a new GEMM shape, and cuBLAS loads its kernels at their first use;
    the capture then finds them loaded), the batches ~0.15 s together. So the batches that reach
    the slowest compiles go first (`PROBES`), then the graphs, then the rest."""
    need = max((blocks_of(b, runner.block_size) for b in batches), default=0)
    if need == 0:
        if workers is not None:
            workers.close()
        return None
    saved = runner.kv_cache
    seconds: list[tuple[float, str]] = []  # (seconds, what) of each part of the dry run

    def run_graphs() -> None:
        if graphs_dry is not None:
            t = time.perf_counter()
            graphs_dry()
            seconds.append((time.perf_counter() - t, "the CUDA graphs' sizes"))

    def run_dry() -> None:
        t = time.perf_counter()
        # The slowest compiles first: the probes' attention, and the fused sampler's variant
        # (ember.kernels.sampling; on float32 logits, as the models' compute_logits gives them).
        for runs in batches[:graphs_after]:
            probe_attention(runner, runs)
        vocab = runner.config.vocab_size
        gumbel_sample(
            torch.zeros(2, vocab, device=runner.device), torch.ones(2, device=runner.device), 0
        )
        seconds.append((time.perf_counter() - t, "the probes' attention and the sampler"))
        for i, runs in enumerate(batches):
            if i == graphs_after:
                run_graphs()
            t = time.perf_counter()
            logits = dummy_step(runner, runs)
            seconds.append((time.perf_counter() - t, _describe(runs)))
        if graphs_after >= len(batches):
            run_graphs()
        # The fused sampler's variant (ember.kernels.sampling), on logits of the model's dtype.
        gumbel_sample(logits, torch.ones(len(logits), device=logits.device), 0)
        slowest = sorted(seconds, reverse=True)[:3]
        log.info(
            "start-up dry run: %d parts in %.2f s, the slowest %s",
            len(seconds),
            sum(s for s, _ in seconds),
            ", ".join(f"{what} {s:.2f} s" for s, what in slowest),
        )

    try:
        runner.allocate_kv_cache(need)
        with one_layer_of_each_kind(runner.model):
            cuda = runner.device.type == "cuda"
            return precompile(run_dry, processes=cuda, procs=workers)
    except torch.OutOfMemoryError as e:
        # A model that barely fits: its kernels then compile at their first launch, as before.
        log.warning("start-up compile skipped (%d temporary KV blocks do not fit): %s", need, e)
        return None
    finally:
        if workers is not None:
            workers.close()  # (precompile closed them; not if the cache did not fit)
        runner.kv_cache = saved
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
            torch.cuda.empty_cache()
