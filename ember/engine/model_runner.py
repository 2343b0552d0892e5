"""Turns a scheduled batch into one forward pass: flat inputs, paged-attention metadata, logits for
the rows that sample, and the sampler. Owns the model and the KV cache tensor."""

from __future__ import annotations

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


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: list[int | None]
    """Parallel to the scheduled requests; None for a prefill chunk that does not sample."""
    logprobs: list[list[tuple[int, float, int]] | None]
    """Per row: (token id, logprob, rank), the sampled token first, then the top alternatives."""


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (num_blocks, cfg.num_hidden_layers, 2, block_size, cfg.num_key_value_heads, cfg.head_dim)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.kv_cache = torch.zeros(
            kv_cache_shape(config, num_blocks, block_size), dtype=dtype, device=device
        )
        self.sampler = Sampler()

    def prepare(self, so: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        for req, n, blocks in zip(so.requests, so.num_scheduled_tokens, so.block_ids, strict=True):
            start = req.num_computed_tokens
            input_ids.extend(req.all_token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
        max_blocks = max(len(b) for b in so.block_ids)
        table = torch.zeros(len(so.block_ids), max_blocks, dtype=torch.int32)
        for i, b in enumerate(so.block_ids):
            table[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        dev = self.device
        md = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=table.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(so.num_scheduled_tokens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos_t, md

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        ids, positions, md = self.prepare(so)
        hidden = self.model(ids, positions, ForwardContext(md, self.kv_cache, self.backend))
        # Only rows whose step reaches the end of their known tokens sample a next token.
        rows = [
            i
            for i, (req, n) in enumerate(zip(so.requests, so.num_scheduled_tokens, strict=True))
            if req.num_computed_tokens + n == req.num_tokens
        ]
        sampled: list[int | None] = [None] * len(so.requests)
        logprobs: list[list[tuple[int, float, int]] | None] = [None] * len(so.requests)
        if not rows:
            return ModelRunnerOutput(sampled, logprobs)
        last = torch.tensor([md.query_start_loc_cpu[i + 1] - 1 for i in rows], device=self.device)
        logits = self.model.compute_logits(hidden[last])
        reqs = [so.requests[i] for i in rows]
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
        tokens = out.sampled.tolist()
        lp = out.logprobs.tolist() if out.logprobs is not None else None
        lp_ids = out.logprob_token_ids.tolist() if out.logprob_token_ids is not None else None
        ranks = out.sampled_ranks.tolist() if out.sampled_ranks is not None else None
        for j, i in enumerate(rows):
            sampled[i] = tokens[j]
            want = reqs[j].sampling_params.logprobs
            if want is not None and lp is not None and lp_ids is not None and ranks is not None:
                entries = [(lp_ids[j][0], lp[j][0], ranks[j])]
                entries += [(lp_ids[j][k], lp[j][k], k) for k in range(1, want + 1)]
                logprobs[i] = entries
        return ModelRunnerOutput(sampled, logprobs)


def _blocked_tokens(req: Request) -> list[int]:
    """EOS and stop ids may not be sampled before `min_tokens` outputs."""
    params = req.sampling_params
    if req.num_output_tokens >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else req.eos_token_ids
    return sorted(set(eos) | set(params.stop_token_ids or ()))
