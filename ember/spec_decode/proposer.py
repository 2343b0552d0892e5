"""What the engine asks of a proposer that drafts on the host from token ids alone."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class HostProposer(ABC):
    """Drafts the next tokens of running requests from their token ids (n-gram, suffix).

    The engine calls `add_request` when a request arrives, `propose` before each step the
    request speculates in (with all of its tokens so far: prompt then output), and `finish` once
    when it ends (its output may then feed later requests of the same `scope`; the engine passes
    an empty output for a request it never speculated for). `add_request` should be cheap: a
    busy server may never speculate for the request, so work on its prompt belongs in the first
    `propose`.

    `scope` is the request's tenant (its cache salt; None is the shared default): a proposer may
    draft from earlier requests' tokens only within the same scope, so that one tenant's answers
    never speed up, or can be timed by, another tenant's requests.
    """

    @abstractmethod
    def add_request(self, request_id: str, prompt: Sequence[int], scope: str | None) -> None: ...

    @abstractmethod
    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` draft tokens to follow `tokens` (possibly none)."""

    @abstractmethod
    def finish(self, request_id: str, output: Sequence[int]) -> None: ...

    def expected_accepted(self, request_id: str) -> float | None:
        """How many of the request's last proposal's tokens the proposer expects to stand (the
        suffix method's score); None where it has no estimate (the engine then uses the rate it
        measured)."""
        return None
