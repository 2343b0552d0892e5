"""What a benchmark sends and what it records: one planned request, one measured request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class PlannedRequest:
    """One request a workload wants sent.

    `body` is the OpenAI request body without `stream`/`stream_options` (the client sets them);
    `path` is "/v1/chat/completions" or "/v1/completions". Open-loop workloads (trace, random) set
    `send_at` (seconds after the start); session workloads (agentic) leave it None and are driven
    turn by turn.
    """

    request_id: str
    path: str
    body: dict[str, Any]
    send_at: float | None = None
    session: str | None = None
    turn: int = 0
    ideal_cached_tokens: int | None = None
    """Trace replay: prompt tokens an ideal prefix cache would hold, from the hash_ids."""

    @property
    def prompt_token_count(self) -> int | None:
        """Tokens of a token-id prompt (trace and random workloads); None for text or chat."""
        prompt = self.body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return len(prompt)
        return None


@dataclass(slots=True)
class RequestRecord:
    """One request as measured by the client (all times in seconds)."""

    request_id: str
    start: float
    """When it was sent, seconds after the run started."""
    session: str | None = None
    turn: int = 0
    ttft: float | None = None
    """Time to the first chunk carrying output (content, text or a tool call)."""
    itl: list[float] = field(default_factory=list)
    """Gaps between consecutive output chunks."""
    e2e: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """usage.prompt_tokens_details.cached_tokens, as the server reported it."""
    ideal_cached_tokens: int | None = None
    sent_prompt_tokens: int | None = None
    """Prompt tokens the client sent, where it knows them (token-id prompts): a failed request's
    share of the ideal hit ratio needs a denominator the server never reported."""
    accepted_prediction_tokens: int | None = None
    """usage.completion_tokens_details.accepted_prediction_tokens: output tokens that came from
    accepted drafts (speculative decoding); None when the server reports none."""
    error: str | None = None
    output_text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (completion_tokens - 1)."""
        if self.ttft is None or self.e2e is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)
