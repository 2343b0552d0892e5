"""What generation returns, in vLLM's shapes."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    from ember.kv_transfer_params import KVTransferParams


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]
"""One entry per prompt token: None for the first (nothing precedes it), then the token's logprob
given the tokens before it and the top alternatives, keyed by token id."""


class TokenIdsView(Sequence[int]):
    """The first `n` ids of a sample's token list, which only grows: a running output's
    token_ids, made without a copy. Every running request gets an output every step, and a copy
    of its whole list cost O(length) a token twice over: the copy, and the garbage collector
    walking every copy's elements (at 256 streams x 1,024 tokens a third of the API process's
    per-token cost, docs/performance.md). Slicing returns a list; a finished output has a list."""

    __slots__ = ("_ids", "_n")

    def __init__(self, ids: list[int], n: int) -> None:
        self._ids, self._n = ids, n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step == 1:
                return self._ids[start:stop]
            return [self._ids[k] for k in range(start, stop, step)]
        j = i + self._n if i < 0 else i
        if not 0 <= j < self._n:
            raise IndexError("token index out of range")
        return self._ids[j]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._ids, self._n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(other) == self._n and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list, which is unhashable

    def __repr__(self) -> str:
        return repr(self._ids[: self._n])


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: Sequence[int]
    """A list when the sample has finished; while it runs, a TokenIdsView of its list."""
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
