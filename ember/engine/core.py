"""The engine core: scheduler + KV cache manager + model runner, advanced one step at a time.

It sees token ids only; text (tokenizing, detokenizing, stop strings) lives in front of it, so a
server can run the core in its own process.
"""

from __future__ import annotations

import logging

import torch

from ember.attention.backend import AttentionBackend
from ember.attention.torch_backend import TorchAttentionBackend
from ember.engine.config import EngineConfig, ResolvedConfig
from ember.engine.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from ember.engine.model_runner import ModelRunner
from ember.engine.request import Request, RequestStatus
from ember.engine.sampler import make_generator
from ember.engine.scheduler import Scheduler, SchedulerConfig
from ember.engine.structured_output import GrammarCompiler
from ember.kv.kv_cache_manager import KVCacheManager
from ember.models.config import ModelConfig
from ember.models.loader import load_model

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        backend: AttentionBackend | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config or ModelConfig.from_dir(config.model)
        self.resolved: ResolvedConfig = config.resolve(self.model_config)
        r = self.resolved
        self.device = torch.device(config.device)
        torch.manual_seed(config.seed)
        model = load_model(
            config.model,
            self.model_config,
            dtype=r.dtype,
            device=self.device,
            load_format=config.load_format,
            max_position=r.max_model_len,
        )
        namespace = (
            f"{self.model_config.architecture}|{config.model}|{r.dtype}|bs={config.block_size}"
        )
        self.kv = KVCacheManager(
            r.num_kv_blocks, config.block_size, config.enable_prefix_caching, namespace
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, r.max_num_batched_tokens, r.max_model_len),
            self.kv,
        )
        self.num_steps = 0
        self.grammar = GrammarCompiler.for_model(config.model, self.model_config)
        self.runner = ModelRunner(
            model,
            self.model_config,
            r.num_kv_blocks,
            config.block_size,
            r.dtype,
            self.device,
            backend or TorchAttentionBackend(),
        )
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB)",
            r.num_kv_blocks,
            config.block_size,
            r.num_kv_blocks * config.block_size,
            r.num_kv_blocks * r.kv_block_bytes / 2**20,
        )

    def add_request(self, msg: EngineCoreRequest) -> None:
        req = Request(
            request_id=msg.request_id,
            prompt_token_ids=msg.prompt_token_ids,
            sampling_params=msg.sampling_params,
            eos_token_ids=frozenset(msg.eos_token_ids),
            max_tokens=msg.max_tokens,
            arrival_time=msg.arrival_time,
            cache_salt=msg.cache_salt,
            generator=None if msg.seed is None else make_generator(msg.seed, self.device),
        )
        if msg.sampling_params.structured_outputs is not None:
            req.matcher = self.grammar.matcher(msg.sampling_params.structured_outputs)
        self.scheduler.add_request(req)

    def abort_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        s, pool = self.scheduler, self.kv.pool
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
        )

    def step(self) -> list[EngineCoreOutput]:
        so = self.scheduler.schedule()
        if so.is_empty:
            return []
        result = self.runner.execute(so)
        self.num_steps += 1
        progressed, _ = self.scheduler.update_from_output(so, result.sampled)
        logprobs_of = {
            req.request_id: lp
            for req, lp in zip(so.requests, result.logprobs, strict=True)
            if lp is not None
        }
        outputs = []
        for req in progressed:
            lp = logprobs_of.get(req.request_id)
            outputs.append(
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[req.output_token_ids[-1]],
                    new_logprobs=[lp] if lp is not None else None,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                )
            )
        return outputs
