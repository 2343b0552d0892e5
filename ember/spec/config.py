"""Speculative decoding settings, checked once."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "suffix", "eagle3")
DEFAULT_MAX_BATCH = 16
"""Without `max_batch`, a GPU engine speculates only while this many requests run or fewer. On
an H200 (SmolLM2, K = 4, docs/performance.md) no cell at batch 32 or 64 gained (0.33-1.01x),
while at batch 8 code edits did (1.2-1.3x) and chat did not (0.8-0.9x): past 16 the cost model
is not trusted with the server's throughput; `--speculative-max-batch` sets another bound (and
then the bound alone decides)."""


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str
    """ "ngram" (prompt lookup), "suffix" (suffix trees over the request and its tenant's recent
    answers) or "eagle3" (a draft head over the target's hidden states)."""
    num_speculative_tokens: int = 4
    """K: the most draft tokens verified per request and step."""
    draft_model: str | None = None
    """eagle3: the draft checkpoint's directory (config.json + safetensors)."""
    max_batch: int | None = None
    """Running requests above which the engine stops speculating (verification would cost more
    than it saves); None: on a GPU up to `DEFAULT_MAX_BATCH` running requests the engine decides
    from the output rates it measures while it serves (`ember.engine.speculation.StepCosts`),
    above it never speculates; on the CPU it always speculates."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if self.method == "eagle3" and not self.draft_model:
            raise ValueError("speculative method eagle3 needs a draft model (--draft-model DIR)")
        if self.max_batch is not None and self.max_batch < 0:
            raise ValueError(f"speculative max_batch must be >= 0, got {self.max_batch}")
