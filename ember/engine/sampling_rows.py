"""One step's sampling rows: a row per sampling request, or with k drafts k + 1 rows (row i
samples as if drafts[:i] had been sampled already), and what each row may sample."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ember.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from ember.engine.structured_output import apply_grammar_masks

if TYPE_CHECKING:
    from ember.engine.request import Request
    from ember.sampling_params import SamplingParams


def sample_rows(
    sampler: Sampler,
    logits: torch.Tensor,
    reqs: list[Request],
    drafts: list[list[int]],
    device: torch.device | str,
) -> SamplerOutput:
    """Sample the step's rows: penalties, min_tokens and the grammar see a verification row's
    earlier drafts, and the drafts are accepted while each equals its row's sample
    (`ember.spec_decode.verify`)."""
    if not drafts:
        drafts = [[] for _ in reqs]
    if any(r.matcher is not None for r in reqs):
        apply_grammar_masks(logits, [r.matcher for r in reqs], drafts)
    rows = [(r, d[:i]) for r, d in zip(reqs, drafts, strict=True) for i in range(len(d) + 1)]
    if all(plain_greedy(r, len(seen)) for r, seen in rows):
        # The common agent case (greedy, nothing to penalise, block or report): an argmax,
        # without the per-row parameter tensors a sampling batch copies to the device.
        return SamplerOutput(logits.argmax(-1), None, None, None)
    any_penalties = any(penalised(r.sampling_params) for r in reqs)
    batch = SamplingBatch.build(
        params=[r.sampling_params for r, _ in rows],
        prompt_ids=[r.prompt_token_ids for r, _ in rows],
        output_ids=[
            r.output_token_ids + seen if seen and any_penalties else r.output_token_ids
            for r, seen in rows
        ],
        generators=[r.generator for r, _ in rows],
        blocked=[blocked_tokens(r, len(seen)) for r, seen in rows],
        vocab_size=logits.shape[-1],
        device=device,
    )
    return sampler(logits, batch)


def penalised(params: SamplingParams) -> bool:
    """Repetition, presence or frequency penalties: the row's logits depend on its tokens."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def plain_greedy(req: Request, num_drafts_before: int) -> bool:
    """A row whose sample is the argmax of its logits (the grammar's mask already applied)."""
    p = req.sampling_params
    return (
        p.greedy
        and p.logprobs is None
        and not penalised(p)
        and not blocked_tokens(req, num_drafts_before)
    )


def blocked_tokens(req: Request, num_drafts_before: int = 0) -> list[int]:
    """EOS and stop ids may not be sampled before `min_tokens` outputs."""
    params = req.sampling_params
    # Outputs before the one this row samples: its own placeholder is already counted, and a
    # verification row comes after the drafts before it.
    before = req.num_output_tokens + req.num_output_placeholders - 1 + num_drafts_before
    if before >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else req.eos_token_ids
    return sorted(set(eos) | set(params.stop_token_ids or ()))
