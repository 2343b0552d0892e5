"""Per-request sampling parameters, shaped like vLLM's SamplingParams.

Validation happens at construction so a bad request fails before it reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Temperatures below this behave as greedy; dividing logits by them only amplifies noise.
SAMPLING_EPS = 1e-5


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar; exactly one of the fields is set."""

    json: str | None = None
    """A JSON schema, as JSON text ('{"type": "object"}' for any object)."""
    regex: str | None = None
    lark: str | None = None
    """A Lark grammar (llguidance's dialect, which may embed `%json {schema}`)."""

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.json, self.regex, self.lark)) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, lark")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables; -1 is normalized to 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None  # normalized to a list
    stop_token_ids: list[int] | None = None  # normalized to a list
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives; 0 returns only the sampled token's logprob
    prompt_logprobs: int | None = None
    """Score the prompt: each prompt token's logprob (and rank) given the tokens before it, plus
    this many top alternatives; None: off. Raw log-softmax of the model, as vLLM's default."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    speculative: bool = True
    """Let the engine speculate for this request when it runs with speculative decoding (the
    output distribution is the same either way; False only saves the verification work)."""

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(
                f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}."
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must contain only non-empty strings, got {self.stop!r}.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must contain non-negative ints, got {self.stop_token_ids!r}."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def clone(self) -> SamplingParams:
        # The lists are the only mutable fields; copy them so the clone owns its own.
        return replace(self, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids))
