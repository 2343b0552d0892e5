"""Speculative decoding settings, checked once."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "suffix", "eagle3")
HYBRID = ("ngram", "suffix")
"""Host proposers that may draft beside an EAGLE-3 head (`SpeculativeConfig.hybrid`)."""
DEFAULT_K = {"ngram": 8, "suffix": 8, "eagle3": 4}
"""K when none is given. Host proposers: 8, since on an H200 (SmolLM2, docs/performance.md) ngram
with K = 8 beat K = 4 in every greedy cell at batch 1 and 8 (code edits 2.80x against 2.31x, tool
calls 1.78x against 1.56x at batch 1), and suffix did at batch 1 (3.38x against 2.64x on code) and
was within 2% at batch 8: their drafts either copy a run whole or stop. EAGLE-3: 4, as its K draft
steps each cost a forward of the head and its acceptance falls with the position."""
DEFAULT_MAX_BATCH = 16
"""Without `max_batch`, a GPU engine speculates only while this many requests run or fewer. On
an H200 (SmolLM2, K = 4, docs/performance.md) no cell at batch 32 or 64 gained more than 1%
(0.33-1.01x), while at batch 8 code edits did (1.2-1.3x) and chat did not (0.8-0.9x): past 16
the cost model is not trusted with the server's throughput; `--speculative-max-batch` sets
another bound (and then the bound alone decides)."""


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str
    """ "ngram" (prompt lookup), "suffix" (suffix trees over the request and its tenant's recent
    answers) or "eagle3" (a draft head over the target's hidden states)."""
    num_speculative_tokens: int = 0
    """K: the most draft tokens verified per request and step, 1 to 16; 0 (the default): the
    method's (`DEFAULT_K`)."""
    draft_model: str | None = None
    """eagle3: the draft checkpoint's directory (config.json + safetensors)."""
    max_batch: int | None = None
    """Running requests above which the engine stops speculating (verification would cost more
    than it saves); None: on a GPU up to `DEFAULT_MAX_BATCH` running requests the engine decides
    from the output rates it measures while it serves (`ember.engine.speculation.StepCosts`),
    above it never speculates; on the CPU it always speculates."""
    hybrid: str | None = None
    """eagle3: a host proposer ("ngram" or "suffix") beside the head. Each step, each request
    verifies the drafts of whichever is expected to have more of them stand: the host
    proposer's estimate (suffix: its score; ngram: its measured rate) against the head's
    measured mean (ember/engine/speculation.py)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        if self.num_speculative_tokens == 0:  # frozen: set once, here
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_K[self.method])
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if self.method == "eagle3" and not self.draft_model:
            raise ValueError("speculative method eagle3 needs a draft model (--draft-model DIR)")
        if self.hybrid is not None and (self.method != "eagle3" or self.hybrid not in HYBRID):
            raise ValueError(
                f"a hybrid proposer ({' or '.join(HYBRID)}) goes beside eagle3, got "
                f"{self.hybrid!r} with {self.method}"
            )
        if self.max_batch is not None and self.max_batch < 0:
            raise ValueError(f"speculative max_batch must be >= 0, got {self.max_batch}")
