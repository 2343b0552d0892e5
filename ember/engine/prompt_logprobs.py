"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): which rows of a step score the next
prompt token, and how a request gathers those scores over a chunked prefill, and a recompute after a
preemption, until they go out with its first token. The scoring itself is `sampler.score_tokens`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.engine.messages import TokenLogprobs
    from ember.engine.request import Request
    from ember.engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class PromptScoring:
    """A step's prompt positions to score against the next prompt token (a chunk's last position
    against the next chunk's first), for the requests that asked."""

    rows: list[int] = field(default_factory=list)
    """Flat rows of the step's hidden states."""
    targets: list[int] = field(default_factory=list)
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    """Per request: (batch index, first position, number of rows, alternatives wanted)."""


def plan_prompt_scoring(so: SchedulerOutput, order: list[int]) -> PromptScoring | None:
    """The rows, in the model runner's flat layout (requests in `order`), that score a prompt
    token; None when no request of the step asks."""
    scoring = PromptScoring()
    flat = 0  # the request's first row
    for i in order:
        req, n, start = so.requests[i], so.num_scheduled_tokens[i], so.num_computed_tokens[i]
        want = req.sampling_params.prompt_logprobs
        if want is not None and req.scores_prompt:
            # Positions already held (scored before a preemption) are not scored again.
            lo = max(start, len(req.prompt_logprobs))
            hi = min(start + n, req.num_prompt_tokens - 1)
            if lo < hi:
                scoring.rows.extend(range(flat + lo - start, flat + hi - start))
                scoring.targets.extend(req.prompt_token_ids[lo + 1 : hi + 1])
                scoring.spans.append((i, lo, hi - lo, want))
        flat += n
    return scoring if scoring.rows else None


def add_prompt_logprobs(req: Request, first: int, entries: list[TokenLogprobs]) -> None:
    """Append a step's scored positions, from `first` on. Those already held are dropped: with
    async scheduling a recompute after a preemption may score them again."""
    held = len(req.prompt_logprobs)
    if first > held:
        raise RuntimeError(
            f"request {req.request_id}: prompt position {first} scored before position {held}"
        )
    req.prompt_logprobs.extend(entries[held - first :])


def take_prompt_logprobs(req: Request) -> list[TokenLogprobs] | None:
    """The prompt's scores, once, for the output of the step that sampled after the whole prompt."""
    if not req.scores_prompt:
        return None
    if len(req.prompt_logprobs) != req.num_prompt_tokens - 1:
        raise RuntimeError(
            f"request {req.request_id}: {len(req.prompt_logprobs)} prompt positions scored, "
            f"{req.num_prompt_tokens - 1} expected"
        )
    req.prompt_logprobs_sent = True
    return req.prompt_logprobs
