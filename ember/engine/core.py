"""The engine core: scheduler + KV cache manager + model runner, advanced one step at a time.

It sees token ids only; text (tokenizing, detokenizing, stop strings) lives in front of it, so a
server can run the core in its own process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from typing import TYPE_CHECKING

import torch
import torch.distributed

from ember.attention.backend import AttentionBackend
from ember.attention.torch_backend import TorchAttentionBackend
from ember.distributed import comm
from ember.distributed import state as parallel_state
from ember.engine import cuda_context
from ember.engine.config import EngineConfig, ResolvedConfig
from ember.engine.dp_attention import DataParallelShare
from ember.engine.expert_load import ExpertLoadMeter
from ember.engine.kv_connector import KVConnector, ShardMap, ShardReader
from ember.engine.kv_tiers import (
    PrefillClock,
    WorkerLowerChannel,
    WorkerReplicas,
    build_replica,
    build_tiers,
    model_fingerprint,
    start_host_memory,
)
from ember.engine.memory import log_memory, size_kv_cache
from ember.engine.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    KVEvents,
    KVTransferParams,
    SchedulerStats,
)
from ember.engine.model_runner import ModelRunner, PendingStep
from ember.engine.prompt_logprobs import add_prompt_logprobs, take_prompt_logprobs
from ember.engine.request import Request, RequestStatus
from ember.engine.sampler import SamplingBatch, make_generator
from ember.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from ember.engine.speculation import Speculator, verify_graph_rows
from ember.engine.startup_clock import StartupClock
from ember.engine.structured_output import GrammarCompiler
from ember.engine.warmup import (
    PROBES,
    AttentionOnly,
    Run,
    compile_probes_early,
    precompile_start_up,
    profile_runs,
    warmup_batches,
)
from ember.engine.workers import Workers
from ember.kernels import compile_log, triton_setup
from ember.kv.data_parallel import DataParallelKV
from ember.kv.kv_cache_manager import KVCacheManager
from ember.kv.transport.block_tags import BlockTagger
from ember.models import checkpoint_files
from ember.models.config import ModelConfig
from ember.models.loader import WeightsLoading, build_model, describe_weights, fill_model

if TYPE_CHECKING:
    from ember.kernels.compile_workers import CompileWorkers
    from ember.kv.tiers.replica import HostReplica

log = logging.getLogger(__name__)
steps_log = logging.getLogger("ember.engine.steps")
"""A DEBUG line a launched step: when (time.monotonic(), the clock `ember bench` stamps requests
with), its rows and tokens, the requests that arrived since the step before (submitted by the API
process, received here), and the host's milliseconds to schedule and launch it. Off unless asked
(`EMBER_DEBUG=ember.engine.steps`, ember/engine/core_proc.py; `benchmarks/step_log.py` reads it):
where the first seconds of a burst of requests went, and a step's host cost."""

MAX_FAILED_STEPS = 3
"""Steps in a row that may fail before the core gives up: past it, the fault is the core's own
(a broken device), not one request's."""


def default_backend(device: torch.device) -> AttentionBackend:
    """Triton kernels on a GPU, the plain-PyTorch reference elsewhere."""
    if device.type == "cuda":
        from ember.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    return TorchAttentionBackend()


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        backend: AttentionBackend | None = None,
    ) -> None:
        self.config = config
        clock = self.startup = StartupClock()
        self.model_config = model_config or ModelConfig.from_dir(config.model)
        self.resolved: ResolvedConfig = config.resolve(self.model_config)
        self.device = torch.device(config.device)
        torch.manual_seed(config.seed)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            cuda_context.wait()  # (a spawned core began the driver's set-up before its imports)
        if on_gpu and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.compile_log = None
        free0 = total = 0
        if on_gpu:
            triton_setup.start()  # (a spawned core began it before its imports)
            torch.cuda.set_device(self.device)
            free0, total = torch.cuda.mem_get_info(self.device)
            # Triton's binaries in ember's home, and a count of what start-up compiles and loads.
            compile_log.use_ember_cache()
            self.compile_log = compile_log.install()
            self.compile_log.begin()
            # Done before anything here uses Triton (a spawned core began it before importing
            # torch; an engine made in process pays it here, as its first compile would).
            triton_setup.wait()
        clock.mark("config")
        self.parallel = parallel_state.current()
        """This process's rank of the engine's devices (one of one without tensor parallelism):
        current wherever this engine runs its model (a process may hold other engines)."""
        self._check_dp_attention()
        if config.enable_dp_attention and not self.parallel.is_parallel:
            # One rank runs the data-parallel attention's code too (its one share is the step).
            self.parallel = dataclasses.replace(self.parallel, dp_attention=True)
        self.workers = self._start_workers()
        with parallel_state.use(self.parallel):
            self._start(clock, backend, free0, total)

    def _start(
        self, clock: StartupClock, backend: AttentionBackend | None, free0: int, total: int
    ) -> None:
        """The model, its compile, the KV cache, the scheduler and the graphs."""
        config, r = self.config, self.resolved
        on_gpu = self.device.type == "cuda"
        backend = backend or default_backend(self.device)
        early = None
        if on_gpu and config.warmup:
            # The slowest compiles start now and go on while the weights load.
            stand_in = AttentionOnly(
                self.model_config, config.block_size, r.dtype, self.device, backend, r.kv_dtype
            )
            early = compile_probes_early(stand_in, self._warmup_batches()[:PROBES])
        loading = None
        # The host tier's memory grows from now on, beside the load and the compile.
        # Every rank's: a tensor-parallel engine's workers repeat rank 0's tier copies on their
        # own heads (ember/kv/tiers/replica.py).
        self._host_memory = start_host_memory(
            config, self.device, r.kv_block_bytes, r.max_model_len
        )
        self.replica: HostReplica | None = None
        try:
            # With the start-up compile to come, the weights load on a thread beside it, and
            # beside the KV sizing and the graphs' capture after it (none of them needs the
            # weights' values, only their places).
            loading = self._load(clock, backend, beside=early is not None)
            if on_gpu:
                self._precompile(clock, early)
            if early is not None:
                early.close()  # (the start-up compile closed it)
                early = None
            self._kv_and_scheduler(clock, total - free0, total)
            if on_gpu and config.warmup and self.model_config.uses_mla:
                self._warm_mla_plans(clock)
            if on_gpu and not config.enforce_eager:
                # The host tier pins its memory in the background: not while graphs are captured.
                memory = self.tiers.host.memory if self.tiers else self._host_memory
                paused = memory.paused() if memory is not None else contextlib.nullcontext()
                with paused:
                    self.runner.capture_cuda_graphs(*self._graph_plan())
                clock.mark("cuda graphs")
            if loading is not None:
                waited = loading.wait()
                self._loaded(loading, waited)
                loading = None
                clock.mark("load")
        except BaseException:
            if self.workers is not None:  # a start that failed: no worker is left behind
                self.workers.close()
                parallel_state.close()
            if (
                self._host_memory is not None
                and getattr(self, "tiers", None) is None
                and self.replica is None
            ):
                self._host_memory.close()  # its growth stops with the start
            if self.replica is not None:
                self.replica.close()
            raise
        finally:
            if early is not None:
                early.close()  # a start that failed before its compile
            if loading is not None:
                loading.close()  # a start that failed before its weights were in
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB)%s",
            self.num_kv_blocks,
            config.block_size,
            self.num_kv_blocks * config.block_size,
            self.num_kv_blocks * r.kv_block_bytes / 2**20,
            f" a rank, each its own requests': {self.parallel.size * self.num_kv_blocks} blocks"
            if self.parallel.dp_attention
            else "",
        )
        if self.compile_log is not None:
            self.compile_log.ready()
        self._pace_host_tier()  # no work yet: it grows
        clock.report()

    def _warm_mla_plans(self, clock: StartupClock) -> None:
        """cuDNN's attention plans for fresh prompts' bucketed lengths (ember/attention/mla.py),
        built now rather than by the first prompt of each length (58-65 ms each on an H200)."""
        from ember.attention.mla import warm_cudnn_plans

        cfg = self.model_config
        heads = cfg.num_attention_heads
        if not self.parallel.dp_attention:
            heads //= self.parallel.size
        n = warm_cudnn_plans(
            heads,
            cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            self.resolved.dtype,
            self.device,
            self.resolved.max_model_len,
        )
        clock.mark("attention plans")
        log.info("MLA: cuDNN attention plans of %d fresh-prompt lengths built", n)

    def _start_workers(self) -> Workers | None:
        """With tensor_parallel_size N > 1 on rank 0: start ranks 1 .. N - 1 and join their
        process group, before the model is built (each rank builds its shard). A worker process
        (its own process group already joined) starts none."""
        config = self.config
        n = config.tensor_parallel_size
        if n == 1 or parallel_state.current().size > 1:
            return None
        if self.device.type == "cuda":
            if self.device.index not in (None, 0):
                raise ValueError("tensor_parallel_size > 1 takes devices cuda:0 .. cuda:N-1")
            if torch.cuda.device_count() < n:
                raise ValueError(
                    f"tensor_parallel_size {n} needs {n} GPUs; {torch.cuda.device_count()} visible"
                )
        if torch.distributed.is_initialized():
            raise ValueError(
                "this process already runs a tensor-parallel engine (one process group a "
                "process): close it first"
            )
        workers = Workers(config, n)
        try:
            workers.wait_joining()
            self.parallel = parallel_state.init(
                0,
                n,
                workers.init_method,
                self.device,
                config.enable_expert_parallel,
                config.enable_dp_attention,
                make_current=False,
            )
        except BaseException:
            workers.close()
            raise
        log.info(
            "tensor parallel: %d ranks (%s%s)",
            n,
            "expert parallel MoE" if config.enable_expert_parallel else "MoE split by width",
            ", data-parallel attention" if config.enable_dp_attention else "",
        )
        return workers

    def _check_dp_attention(self) -> None:
        """Data-parallel attention is multi-head latent attention's, and keeps each request's KV
        on one rank: the KV tiers and a draft head, which do not place it, are refused."""
        config = self.config
        if not config.enable_dp_attention:
            return
        if not self.model_config.uses_mla:
            raise ValueError(
                "enable_dp_attention needs a model with multi-head latent attention (DeepSeek-V3, "
                "Kimi K2): other models' KV heads split across the ranks already"
            )
        refused = {
            "kv_host_gb": bool(config.kv_host_gb),
            "kv_disk_dir": config.kv_disk_dir is not None,
            "kv_store": config.kv_store is not None,
            "speculative 'eagle3'": config.speculative is not None
            and config.speculative.method == "eagle3",
        }
        for name, on in refused.items():
            if on:
                raise ValueError(
                    f"{name} is not supported with enable_dp_attention: a request's KV lives "
                    "on one rank's cache, which the KV tiers and a draft head's cache do not "
                    "place"
                )

    def _kv_and_scheduler(self, clock: StartupClock, used_before: int, total: int) -> None:
        """The KV cache sized (on a GPU, from what the weights and a profiled step leave of
        `total`, `used_before` bytes taken by others) and allocated, its tiers, the KV
        connector and the scheduler."""
        config, r = self.config, self.resolved
        on_gpu = self.device.type == "cuda"
        num_blocks = r.num_kv_blocks
        if on_gpu and config.num_kv_blocks is None:
            num_blocks = size_kv_cache(self.runner, r, config, used_before, total)
            if self.runner.drafter is not None:  # its one layer of KV shares the budget
                per_block = r.kv_block_bytes + self.runner.drafter.kv_block_bytes
                num_blocks = num_blocks * r.kv_block_bytes // per_block
        # Every rank holds the same blocks (its heads' share of each): the smallest room decides.
        num_blocks = comm.all_reduce_min(num_blocks)
        clock.mark("kv sizing")
        self.num_kv_blocks = num_blocks
        if self.parallel.dp_attention:  # each rank's blocks, and so its requests
            self.runner.share_requests(
                DataParallelShare(self.parallel.rank, num_blocks, config.block_size)
            )
        transport = None
        if config.kv_role != "both":
            from ember.kv.transport import make_transport, resolve_kind

            kind = resolve_kind(config.kv_transport, config.device)
            transport = make_transport(kind, config.kv_host, config.kv_timeout_s)
        # The KV cache in memory the transport can hand to peers (shared memory on the CPU).
        self.runner.allocate_kv_cache(num_blocks, transport.allocate if transport else None)
        if on_gpu:
            log_memory(self.runner, self.parallel.rank, self.parallel.size)
        # Where this rank's KV heads lie in a prefill engine's blocks (of any number of ranks).
        shards = None
        if transport is not None:
            shards = ShardMap.of(
                self.model_config, self.runner.kv_cache, self.parallel.rank, self.parallel.size
            )
        self.kv_reader: ShardReader | None = None
        if not self.parallel.is_driver:
            # A worker's part ends with its KV cache: rank 0 schedules; a decode engine's worker
            # reads its heads of the prompts' KV when rank 0 says, a prefill engine's registers
            # its cache for decode engines to read (ember/engine/worker_main.py).
            self.tiers, self.connector = None, None
            if transport is not None and shards is not None:
                tagger = None
                if transport.exposed:  # its share of every leased block is tagged and checked
                    tagger = BlockTagger(config.cluster_secret, self.runner.kv_cache)
                self.kv_reader = ShardReader(transport, self.runner.kv_cache, shards, tagger)
            # None without prefix caching or a host tier (its memory then closed).
            self.replica = build_replica(
                config, self.runner.kv_cache, r.max_model_len, self._host_memory
            )
            return
        if self.runner.drafter is not None:
            self.runner.drafter.allocate_kv_cache(num_blocks)
        # Block hashes name the model by what it computes, not by its path: every engine of the
        # same model, on any node, names a block the same (the KV tiers and the router rely on it).
        fingerprint = model_fingerprint(config.model, config.load_format, self.device)
        namespace = (
            f"{self.model_config.architecture}|{fingerprint}|{r.dtype}|bs={config.block_size}"
        )
        if r.kv_dtype != r.dtype:  # an FP8 cache's blocks are no other engine's
            namespace += f"|kv={r.kv_dtype_name}"
        self._replicas = WorkerReplicas(self.workers) if self.workers is not None else None
        self.tiers = build_tiers(
            config,
            self.runner.kv_cache,
            fingerprint,
            r.max_model_len,
            self._host_memory,
            self._replicas,
            WorkerLowerChannel(self.workers) if self.workers is not None else None,
        )
        self.kv: KVCacheManager | DataParallelKV
        if self.parallel.dp_attention:
            # Each rank's cache its own requests' (ember/engine/dp_attention.py).
            self.kv = DataParallelKV(
                self.parallel.size,
                num_blocks,
                config.block_size,
                config.enable_prefix_caching,
                namespace,
                config.kv_events,
                eviction=config.kv_eviction,  # type: ignore[arg-type]  # checked by EngineConfig
            )
        else:
            self.kv = KVCacheManager(
                num_blocks,
                config.block_size,
                config.enable_prefix_caching,
                namespace,
                config.kv_events,
                track_writes=self.tiers is not None,
                eviction=config.kv_eviction,  # type: ignore[arg-type]  # checked by EngineConfig
            )
        self.engine_id = uuid.uuid4().hex[:12]
        self.connector: KVConnector | None = None
        if transport is not None:
            self.connector = KVConnector(
                config.kv_role,
                self.kv,
                self.runner.kv_cache,
                transport,
                self.engine_id,
                config.kv_lease_s,
                secret=config.cluster_secret,
                timeout_s=config.kv_timeout_s,
                shards=shards,
                workers=self.workers,
            )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, r.max_num_batched_tokens, r.max_model_len),
            self.kv,
            self.connector,
            self.tiers,
        )
        self.spec: Speculator | None = None
        if config.speculative is not None:
            self.spec = Speculator(config.speculative, measure=on_gpu)
            self.scheduler.on_finish = self.spec.finish
            if self.runner.drafter is not None:
                self.scheduler.num_lookahead_tokens = self.runner.num_draft_tokens
        self.num_steps = 0
        self._arrived: list[tuple[float, float]] = []
        """When the requests added since the last step were submitted (the API process's clock
        at its send) and received here: the step log's."""
        self.async_scheduling = (
            on_gpu if config.async_scheduling is None else config.async_scheduling
        )
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None
        self._batches: list[SchedulerOutput] = []  # the running step's, for _fail_step
        self._outputs: list[EngineCoreOutput] = []
        self.failed_steps = 0
        self.prefill_clock = (
            PrefillClock(self.tiers.cost, config.block_size, on_gpu) if self.tiers else None
        )
        self.grammar = GrammarCompiler.for_model(config.model, self.model_config)
        if self.workers is not None:
            self.runner.send_plan = self.workers.send
        self.expert_load = ExpertLoadMeter(self.runner.model)
        clock.mark("kv cache, tiers, scheduler")

    def _load(
        self, clock: StartupClock, backend: AttentionBackend, beside: bool = False
    ) -> WeightsLoading | None:
        """The model, its runner and (EAGLE-3) the draft head. `beside`: the start-up compile
        follows, so a checkpoint's weights load on a thread while it runs (the loading is
        returned, to wait for before anything runs for real); an EAGLE-3 head, built from the
        target's weights, loads them first."""
        config, r = self.config, self.resolved
        spec = config.speculative
        eagle3 = spec is not None and spec.method == "eagle3" and bool(spec.draft_model)
        beside = beside and config.load_format != "dummy" and not eagle3
        model = build_model(
            config.model,
            self.model_config,
            dtype=r.dtype,
            device=self.device,
            load_format=config.load_format,
            max_position=r.max_model_len,
        )
        quant = self.model_config.quant
        log.info(
            "model: %s, weights %s",
            f"quantized, {quant.describe()}" if quant else "unquantized",
            describe_weights(model),
        )
        loading = None
        if beside:
            loading = WeightsLoading(model, config.model, r.dtype, self.device)
        else:
            fill_model(model, config.model, config.load_format, r.dtype, self.device)
            self._loaded(None, 0.0)
        try:
            self.runner = ModelRunner(
                model,
                self.model_config,
                config.block_size,
                r.dtype,
                self.device,
                backend,
                max_num_seqs=config.max_num_seqs,
                kv_dtype=r.kv_dtype,
            )
        except BaseException:
            if loading is not None:
                loading.close()  # (the caller never sees it)
            raise
        clock.mark("model" if beside else "load")
        if eagle3 and self.parallel.is_driver:
            from ember.spec_decode.eagle3 import Eagle3Drafter

            # Before the KV sizing and the graphs: the head's weights count as weights, and the
            # target hands out its hidden states in every captured step. On rank 0 alone: the
            # head drafts from the hidden states every rank holds whole, with no collective.
            self.runner.drafter = Eagle3Drafter(
                spec.draft_model,
                model,
                config.block_size,
                r.dtype,
                self.device,
                self.runner.backend,
                target_dir=config.model,
            )
        if eagle3:  # every rank: the verify steps' shapes (their graphs) follow from it
            self.runner.num_draft_tokens = spec.num_speculative_tokens
        return loading

    def _loaded(self, loading: WeightsLoading | None, waited_s: float) -> None:
        """The weights are in: the read-ahead stops, and the log says how long they took
        (`loading`: the thread they loaded on, `waited_s` how long the start-up waited for it
        after its compile, KV sizing and graphs' capture)."""
        ahead = checkpoint_files.started()
        if ahead is not None:
            ahead.stop.set()  # what it has not read by now the loader has
            log.info("weights read ahead of the load: %s", ahead.summary())
        if loading is not None:
            log.info(
                "weights loaded in %.1f s on a thread beside the start-up compile, the KV "
                "sizing and the graphs' capture (%.1f s waited for after them)",
                loading.seconds,
                waited_s,
            )

    def _warmup_batches(self) -> list[list[Run]]:
        config, r = self.config, self.resolved
        graph_batch = 0 if config.enforce_eager else config.max_cuda_graph_batch
        return warmup_batches(
            r.max_num_batched_tokens,
            config.max_num_seqs,
            r.max_model_len,
            graph_batch,
            config.block_size,
        )

    def _graph_plan(self) -> tuple[int, int, int, int, int]:
        """The decode graphs' (max batch, max model length, verify rows, rows a request) and the
        largest step with prompt tokens that replays piecewise graphs."""
        config, r = self.config, self.resolved
        batch = min(config.max_cuda_graph_batch, config.max_num_seqs)
        spec = config.speculative
        k = spec.num_speculative_tokens if spec else 0
        rows = verify_graph_rows(spec, batch) if spec else 0
        pieces = min(config.max_piecewise_tokens, r.max_num_batched_tokens)
        return batch, r.max_model_len, rows, k + 1, pieces

    def _precompile(self, clock: StartupClock, early: CompileWorkers | None = None) -> None:
        """Compile, in parallel and before anything runs for real, the Triton variants of the
        profiled step and (with the warm-up) of the batch shapes serving meets
        (ember/engine/warmup.py), so no request waits on a compilation. `early`: the workers
        already compiling the probes' variants (started before the model loaded)."""
        config, r = self.config, self.resolved
        batches = []
        if config.warmup:
            batches += self._warmup_batches()
        # Last: the warm-up's first batches are the ones that start the slowest compiles.
        batches.append(profile_runs(r.max_num_batched_tokens, r.max_model_len, config.max_num_seqs))
        graphs_dry = None
        if not config.enforce_eager:
            graphs_dry = self.runner.prepare_cuda_graphs(*self._graph_plan())
        probes = PROBES if config.warmup else 0
        done = precompile_start_up(
            self.runner, batches, graphs_dry, graphs_after=probes, workers=early
        )
        # The dry run's variants whose compiles had started before the load (the same jobs).
        early_n = early.reused if early is not None else 0
        clock.mark("precompile")
        if done is not None:
            log.info(
                "start-up compile: %d Triton kernel variants from %d batch shapes run dry "
                "(%.1f s, compiling in parallel as they were met, in %d processes forked in "
                "%.2f s), "
                "all compiled or loaded %.1f s after the dry run began and their launchers "
                "built %.1f s after it ended (%d of them started before the model loaded); "
                "the last compiled: %s",
                done.variants,
                len(batches),
                done.dry_s,
                done.workers,
                done.fork_s,
                done.compiled_s,
                done.compile_s,
                early_n,
                done.critical(),
            )
        if self.compile_log is not None:
            self.compile_log.mark()

    def add_request(self, msg: EngineCoreRequest) -> None:
        if steps_log.isEnabledFor(logging.DEBUG):
            self._arrived.append((msg.arrival_time, time.monotonic()))
        req = Request(
            request_id=msg.request_id,
            prompt_token_ids=msg.prompt_token_ids,
            sampling_params=msg.sampling_params,
            eos_token_ids=frozenset(msg.eos_token_ids),
            max_tokens=msg.max_tokens,
            arrival_time=msg.arrival_time,
            cache_salt=msg.cache_salt,
            generator=None if msg.seed is None else make_generator(msg.seed, self.device),
            kv_transfer=msg.kv_transfer,
        )
        kvt = msg.kv_transfer
        if kvt is not None and kvt.do_remote_prefill:
            # A decode leg: the prefill engine sampled the first token; decoding goes on from it.
            if not 0 <= kvt.first_token_id < self.model_config.vocab_size:
                raise ValueError(
                    f"kv_transfer_params.first_token_id {kvt.first_token_id} is invalid"
                )
            req.append_output_token(kvt.first_token_id)
            if req.generator is not None and not msg.sampling_params.greedy:
                # The prefill engine drew the first token from this seed: draw as it did, so the
                # tokens after it are the ones one engine alone would sample.
                noise = torch.empty(self.model_config.vocab_size, device=self.device)
                noise.exponential_(generator=req.generator)
            if (
                self.connector is None
                or self.connector.role != "decode"
                or kvt.num_prompt_tokens != len(msg.prompt_token_ids)
                or req.scores_prompt  # read KV has no logits to score the prompt with
            ):
                req.kv_transfer = None  # nothing to read it with, or not our prompt: prefill here
        if msg.sampling_params.structured_outputs is not None:
            req.matcher = self.grammar.matcher(msg.sampling_params.structured_outputs)
        self._check_sampleable(req)
        self.scheduler.add_request(req)
        if self.spec is not None:
            self.spec.add_request(req)
        self._pace_host_tier()

    def _check_sampleable(self, req: Request) -> None:
        """Build this request's sampling row alone, on the host: a value the sampler cannot
        represent (an int64 overflow, an id outside the vocabulary) fails here, for this request
        only, not later inside a batch of other users' requests."""
        p = req.sampling_params
        vocab = self.model_config.vocab_size
        if p.prompt_logprobs is not None and p.prompt_logprobs > vocab:
            raise ValueError(
                f"prompt_logprobs must be at most vocab_size={vocab}, got {p.prompt_logprobs}."
            )
        blocked = [] if p.min_tokens == 0 else [*req.eos_token_ids, *(p.stop_token_ids or ())]
        # Penalties are plain floats (range-checked at the edge) but make build() count the
        # vocabulary: 1.3 ms a request against 27 us without them (128k vocabulary, measured).
        cheap = dataclasses.replace(
            p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0
        )
        SamplingBatch.build(
            [cheap],
            [req.prompt_token_ids],
            [req.output_token_ids],
            [req.generator],
            [blocked],
            vocab,
            "cpu",
        )

    def abort_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        finished = self.scheduler.finish_requests(request_ids, status)
        c = self.connector
        if c is not None and c.role == "prefill" and status is RequestStatus.FINISHED_ABORTED:
            # The API gave up on a prefill it had not seen finish (its client left): a lease the
            # core took meanwhile reached no one, so nothing will release it before it expires.
            for rid in request_ids:
                c.release(f"{self.engine_id}:{rid}")
        return finished

    def _lease_of(self, req: Request) -> KVTransferParams | None:
        """A finished prefill-role request's lease, for its last output."""
        c = self.connector
        if c is None or c.role != "prefill" or not req.is_finished or req.kv_transfer is None:
            return None
        return req.kv_transfer if req.kv_transfer.lease_id else None

    def _lease_until(self, lease: KVTransferParams | None) -> float:
        if lease is None or self.connector is None:
            return 0.0
        held = self.connector.leases.get(lease.lease_id)
        return held[1] if held is not None else 0.0

    def release_lease(self, lease_id: str) -> bool:
        return self.connector is not None and self.connector.release(lease_id)

    def expire_leases(self) -> None:
        if self.connector is not None and self.connector.role == "prefill":
            self.connector.expire()

    def drain_kv_events(self) -> KVEvents | None:
        events = [(kind, h, "gpu") for kind, h in self.kv.pool.drain_events()]
        if self.tiers is not None:
            events += self.tiers.drain_events()
        return KVEvents(events) if events else None

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
        if self.kv_reader is not None:
            self.kv_reader.close()
        if self.tiers is not None:
            self.tiers.close()  # after the writes queued so far: a restart finds them on disk
        if self.replica is not None:
            self.replica.close()
        if self.workers is not None:
            self.workers.close()
            self.workers = None
            parallel_state.close()

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
            or self._offloading()  # GPU -> host copies to commit, even when idle
        )

    def stats(self) -> SchedulerStats:
        s, pool, c, t = self.scheduler, self.kv.pool, self.connector, self.tiers
        tiers = t.stats() if t is not None else {}
        prefill = sum(r.num_prompt_tokens - r.num_computed_tokens for r in s.waiting)
        decode = 0
        for r in s.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                prefill += r.num_prompt_tokens - r.num_computed_tokens
            else:
                decode += r.num_tokens
        return SchedulerStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_prefill_tokens=prefill,
            num_decode_tokens=decode,
            kv_usage=pool.usage,
            num_free_blocks=pool.num_free_blocks,
            num_blocks=pool.num_blocks,
            prefix_queries=s.prefix_queries,
            prefix_hits=s.prefix_hits,
            num_preemptions=s.num_preemptions,
            num_steps=self.num_steps,
            num_leases=len(c.leases) if c else 0,
            lease_expiries=c.lease_expiries if c else 0,
            remote_kv_loads=c.loads if c else 0,
            remote_kv_failures=c.load_failures if c else 0,
            remote_kv_bytes=c.load_bytes if c else 0,
            remote_kv_seconds=c.load_seconds if c else 0.0,
            kv_tiers=tiers,
            kv_tier_bandwidth={m: t.cost.bandwidth(m) for m in tiers} if t is not None else {},
            prefill_tok_s=t.cost.prefill_tok_s if t is not None else 0.0,
            **(self.spec.stats() if self.spec is not None else {}),
            expert_load=self._expert_loads(),
        )

    def _expert_loads(self) -> list[int]:
        """Each rank's expert load (ember/engine/expert_load.py), rank 0's first."""
        own = self.expert_load.poll()
        if own is None:
            return []
        others = self.workers.read_reports() if self.workers is not None else {}
        return [own] + [others.get(r, 0) for r in range(1, self.parallel.size)]

    def step(self) -> list[EngineCoreOutput]:
        with parallel_state.use(self.parallel):
            return self._step_safely()

    def _step_safely(self) -> list[EngineCoreOutput]:
        """Schedule and launch a step; return the outputs of the step that finished.

        With async scheduling the step launched here is collected by the next call, so the host
        schedules and prepares step N+1 while the GPU runs step N; without it, by this call.
        A step that raises fails its own requests (with finish_reason "error") and the core goes
        on; MAX_FAILED_STEPS in a row raise.
        """
        if self.workers is not None:
            self.workers.check()
        try:
            outputs = self._step()
        except Exception as e:
            self.failed_steps += 1
            # A tensor-parallel step that failed on rank 0 may have left the other ranks inside
            # a collective: the engine cannot go on.
            if self.workers is not None:
                self.workers.explain(e)
                raise
            if self.failed_steps >= MAX_FAILED_STEPS:
                raise
            log.exception("engine step failed; failing its requests")
            return self._fail_step(e)
        self.failed_steps = 0
        return outputs

    def _fail_step(self, err: Exception) -> list[EngineCoreOutput]:
        """End every request of the failed step's batches with an error; keep their tokens."""
        batches = [so.requests for so in self._batches] or [self.scheduler.running]
        victims = {r.request_id: r for reqs in batches for r in reqs}
        outputs, self._outputs, self._batches, self._in_flight = self._outputs, [], [], None
        for req in victims.values():
            # Blocks published at scheduling may hold unwritten KV: out of the index, and not
            # copied down to the tiers.
            self.kv.unpublish(req.request_id)
        self.kv.pool.drain_published()
        ended = self.scheduler.finish_requests(list(victims), RequestStatus.FINISHED_ABORTED)
        reason = f"engine error: {type(err).__name__}: {err}"
        return outputs + [
            EngineCoreOutput(r.request_id, [], finish_reason="error", stop_reason=reason)
            for r in ended
        ]

    def _step(self) -> list[EngineCoreOutput]:
        # Kept on self while the step runs, so that a failure knows its requests and outputs.
        outputs = self._outputs = []
        self._batches = [self._in_flight[0]] if self._in_flight is not None else []
        if self.spec is not None:
            self.spec.plan(self.scheduler.running)
        if self._in_flight is not None and self._must_wait():
            outputs += self._collect()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        scheduling = time.monotonic()
        so = self.scheduler.schedule()
        self._batches.append(so)
        launched = None
        if not so.is_empty:
            if self.tiers is not None:
                # Blocks handed out again may still be being copied down: the GPU waits first.
                self.tiers.fence(self.kv.pool.drain_allocated())
            launched = (so, self.runner.launch(so))
            self.num_steps += 1
            if steps_log.isEnabledFor(logging.DEBUG):
                self._log_step(so, scheduling)
        elif self._in_flight is None and (
            self.scheduler.loading or self.scheduler.awaiting_lookup or self._offloading()
        ):
            time.sleep(0.001)  # only KV reads, copies or lookups pending: let their threads run
        if self.tiers is not None:
            # Write-through: blocks published by this step go down once the step has written them.
            self.tiers.offload(self.kv.pool.drain_published())
        if self._in_flight is not None:
            outputs += self._collect()
        self._in_flight = launched
        if not self.async_scheduling and launched is not None:
            outputs += self._collect()
        if self.tiers is not None:
            self.tiers.step_done()
            self._pace_host_tier()
        self._outputs, self._batches = [], []
        return outputs

    def _log_step(self, so: SchedulerOutput, scheduling: float) -> None:
        """`scheduling`: when this step's scheduling began (the line's time is its launch's end)."""
        now, a = time.monotonic(), self._arrived
        prefill = sum(n > 1 for n in so.num_scheduled_tokens)
        arrivals = ""
        if a:
            sub, got = [x for x, _ in a], [y for _, y in a]
            arrivals = (
                f" (submitted {min(sub):.4f} to {max(sub):.4f}, received {min(got):.4f} to "
                f"{max(got):.4f})"
            )
        steps_log.debug(
            "step %d at %.4f: %d rows (%d prefilling), %d tokens; %d waiting, %d arrived since%s; "
            "scheduled and launched in %.2f ms",
            self.num_steps, now, len(so.requests), prefill, so.total_num_scheduled_tokens,
            len(self.scheduler.waiting), len(a), arrivals, (now - scheduling) * 1e3,
        )  # fmt: skip
        self._arrived = []

    def _pace_host_tier(self) -> None:
        """The host tier's memory grows while the engine has no work, and beside requests only
        once the GPU cache evicts (the tier then starts to hold what the GPU lost) or disk and
        store need it to stage their copies: pinning beside requests slowed them by up to a
        quarter (ember/kv/tiers/host_memory.py)."""
        t = self.tiers
        if t is None or t.host.memory.full:
            return
        if not self.scheduler.has_unfinished_requests() and self._in_flight is None:
            t.host.memory.pace = "idle"
        elif t.lower or self.kv.pool.num_evictions:
            t.host.memory.pace = "busy"
        else:
            t.host.memory.pace = "hold"
        if self._replicas is not None:
            self._replicas.pace(t.host.memory.pace)

    def _offloading(self) -> bool:
        return self.tiers is not None and self.tiers.pending_offloads > 0

    def _must_wait(self) -> bool:
        """The next step needs the tokens of the one in flight on the host (grammar, penalties)."""
        return not self.async_scheduling or any(
            r.needs_known_tokens for r in self.scheduler.running
        )

    def _collect(self) -> list[EngineCoreOutput]:
        if self._in_flight is None:
            return []
        so, pending = self._in_flight
        self._in_flight = None
        result = self.runner.finish(pending)
        if self.prefill_clock is not None:
            self.prefill_clock.observe(so, pending)
        for i, scored in enumerate(result.prompt_logprobs):
            if scored is not None:
                add_prompt_logprobs(so.requests[i], *scored)
        before = {r.request_id: r.num_output_tokens for r in so.requests}
        progressed, _ = self.scheduler.update_from_output(so, result.sampled, result.accepted)
        if self.spec is not None:
            self.spec.record_step(so, result.accepted, pending.launched_at)
            for req, drafts in zip(so.requests, result.drafts, strict=False):
                if drafts and req.speculates and not req.is_finished:
                    req.spec_token_ids = drafts
                    req.spec_from_host = False  # the head's (a hybrid proposer may take over)
        logprobs_of = {
            req.request_id: lp
            for req, lp in zip(so.requests, result.logprobs, strict=True)
            if lp is not None
        }
        outputs = []
        for req in progressed:
            new = req.output_token_ids[before[req.request_id] :]
            lp = logprobs_of.get(req.request_id)
            outputs.append(
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=new,
                    new_logprobs=lp[: len(new)] if lp is not None else None,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    kv_transfer_params=(lease := self._lease_of(req)),
                    lease_until=self._lease_until(lease),
                    prompt_logprobs=take_prompt_logprobs(req),
                    spec_draft_tokens=req.spec_draft_tokens,
                    spec_accepted_tokens=req.spec_accepted_tokens,
                )
            )
        return outputs
