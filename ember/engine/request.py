"""One generation request as the engine core sees it: tokens, progress, status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher

    from ember.engine.messages import TokenLogprobs
    from ember.kv_transfer_params import KVTransferParams
    from ember.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    WAITING_FOR_TIER_KV = "waiting_for_tier_kv"
    """Its prompt's blocks are being loaded from host, disk or store into the GPU."""
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    """Resolved limit on output tokens (the request's, capped by the context length)."""
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache or is being written by a scheduled step (the scheduler
    advances it when it schedules a step, not when the step returns)."""
    num_output_placeholders: int = 0
    """Tokens sampled by scheduled steps that have not come back to the host yet. The scheduler
    may schedule a decode on such a token: the model runner feeds it from the GPU."""
    num_cached_tokens: int = -1
    """Prompt tokens not computed when first scheduled, found in the GPU prefix cache or loaded
    from a KV tier (-1: not yet scheduled)."""
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    generator: torch.Generator | None = None
    matcher: LLMatcher | None = None
    """The structured-output grammar's state, when the request has one."""
    num_preemptions: int = 0
    kv_transfer: KVTransferParams | None = None
    """Disaggregation: `do_remote_decode` (hold the KV for a decode engine when done) or
    `do_remote_prefill` (read the prompt's KV from a prefill engine before decoding)."""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """With `prompt_logprobs` asked: the prompt positions scored so far (entry p scores prompt
    token p + 1), gathered over the prefill's chunks."""
    prompt_logprobs_sent: bool = False
    """They went out with the first token: a recompute after a preemption scores nothing again."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: draft tokens for the next step to verify (taken by the scheduler)."""
    verifying: bool = False
    """A step verifying its drafts is in flight: the next one waits for its tokens (how many
    stand decides where the next step starts)."""
    spec_draft_tokens: int = 0
    """Draft tokens verified for this request so far, and how many of them stood."""
    spec_accepted_tokens: int = 0
    speculates: bool = False
    """The engine speculates for this request now: its drafts are made from its known tokens, so
    its steps are not scheduled ahead of their tokens (see `needs_known_tokens`)."""
    speculated: bool = False
    """The engine speculated for this request at some step (its proposer state was used)."""
    spec_misses: int = 0
    """Host proposals in a row that gave no draft or none that stood."""
    spec_backoff: int = 0
    """Steps this request sits out of speculation (they run async) after its misses."""
    spec_from_host: bool = False
    """EAGLE-3 with a hybrid host proposer: the drafts to verify are the host proposer's."""
    spec_stale: bool = False
    """EAGLE-3: a step ran this request past the batch bound without growing the draft head's
    KV (a busy engine pays nothing for the head), so the request drafts no more."""

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_known_tokens(self) -> bool:
        """Sampling reads this request's own tokens on the host (a grammar, penalties), so its next
        step cannot be scheduled before the last one's token is back."""
        p = self.sampling_params
        return (
            self.speculates
            or self.verifying
            or self.matcher is not None
            or p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
        )

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's logprobs are asked for and not yet sent: every prompt position must be
        computed here (no prefix-cache hits, no KV read from another engine)."""
        return self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
