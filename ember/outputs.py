"""What generation returns, in vLLM's shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.engine.messages import KVTransferParams


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]
"""One entry per prompt token: None for the first (nothing precedes it), then the token's logprob
given the tokens before it and the top alternatives, keyed by token id."""


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    """'stop', 'length' or 'abort'; None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it (None for EOS or length)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    kv_transfer_params: KVTransferParams | None = None
    """Prefill role: where the prompt's KV waits for a decode engine (on the final output)."""
    prompt_logprobs: PromptLogprobs | None = None
    """With SamplingParams.prompt_logprobs: set from the first output on."""
    spec_draft_tokens: int = 0
    """Speculative decoding: draft tokens verified for this request (all its samples)."""
    spec_accepted_tokens: int = 0
    """Of them, those accepted: output tokens that cost no forward pass of their own."""
