"""Prompt lookup ("ngram"): draft the tokens that followed the most recent earlier occurrence of
the request's last few tokens, found in the request's own prompt and output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ember.spec_decode.proposer import HostProposer


@dataclass(slots=True)
class _RequestIndex:
    """One request's tokens and, for every n-gram (min_n..max_n) that ends before its last token,
    where its most recent occurrence starts. The index lags the tokens by one so that the
    request's current suffix never finds itself: a hit is always an earlier occurrence.

    Keys are the n-grams' hashes, not the tuples (less memory, and nothing for the garbage
    collector to track); a hit is checked against the tokens, so a hash collision can only lose
    a draft, never make one up."""

    tokens: list[int] = field(default_factory=list)
    last_start: dict[int, int] = field(default_factory=dict)


class NgramProposer(HostProposer):
    """vLLM's "ngram" method, with an index kept per request and updated as tokens arrive.

    A propose costs one dict lookup per n-gram length plus the indexing of the tokens that
    arrived since the last call (one hash per n-gram length each), never a scan of the request:
    a long prompt is indexed once, at the request's first propose. Drafts are capped at `k`
    tokens.
    """

    def __init__(self, k: int, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if k < 1:
            raise ValueError(f"ngram proposer needs k >= 1, got {k}")
        self.k = k
        self.min_n = min_n
        self.max_n = max_n
        self._requests: dict[str, _RequestIndex] = {}

    def add_request(self, request_id: str, prompt: Sequence[int], scope: str | None) -> None:
        # Prompt lookup reads only the request's own tokens, so the scope plays no part. The
        # prompt is indexed at the first propose, not here: a request the engine never
        # speculates for (a busy server turns speculation off) costs nothing (a 3k-token prompt
        # took ~2 ms to index, 64 of them 140 ms of a batch's time on an H200's host).
        self._requests[request_id] = _RequestIndex()

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> list[int]:
        index = self._requests.get(request_id)
        if index is None:
            raise KeyError(f"ngram proposer: request {request_id!r} was never added")
        self._sync(index, tokens)
        limit = min(max_tokens, self.k)
        toks = index.tokens
        n_tokens = len(toks)
        if limit <= 0:
            return []
        # Longest suffix first; an n-gram needs an earlier occurrence, hence n < n_tokens.
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            suffix = toks[n_tokens - n :]
            start = index.last_start.get(hash(tuple(suffix)))
            if start is not None and toks[start : start + n] == suffix:
                return toks[start + n : start + n + limit]
        return []

    def finish(self, request_id: str, output: Sequence[int]) -> None:
        self._requests.pop(request_id, None)

    def _sync(self, index: _RequestIndex, tokens: Sequence[int]) -> None:
        """Bring the index up to `tokens`, which normally extend what it holds. A shorter or
        different sequence (checked on the last token held only, to stay O(1)) rebuilds it."""
        held = index.tokens
        n = len(held)
        if len(tokens) < n or (n and tokens[n - 1] != held[n - 1]):
            held.clear()
            index.last_start.clear()
            n = 0
        if len(tokens) > n:
            self._extend(index, tokens[n:])

    def _extend(self, index: _RequestIndex, new_tokens: Sequence[int]) -> None:
        """Append tokens and index every n-gram that now ends before the last token. For many
        tokens (a prompt) the zips below run in C: about a microsecond per token."""
        if not new_tokens:
            return
        toks = index.tokens
        old_len = len(toks)
        toks.extend(new_tokens)
        # N-grams ending at positions old_len - 1 .. len - 2 (inclusive) become "earlier" ones.
        first_end = old_len  # exclusive end of the first new n-gram
        last_end = len(toks) - 1  # exclusive end of the last one
        if last_end < first_end:
            return
        table = index.last_start
        if last_end - first_end < 8:
            # A few tokens (a decode step): plain slices beat setting up the zips below.
            for end in range(first_end, last_end + 1):
                for n in range(self.min_n, min(self.max_n, end) + 1):
                    table[hash(tuple(toks[end - n : end]))] = end - n
            return
        for n in range(self.min_n, self.max_n + 1):
            lo = max(first_end - n, 0)  # first start to index
            hi = last_end - n  # last start to index
            if hi < lo:
                continue
            window = toks[lo : hi + n]
            grams = zip(*(window[i : len(window) - n + 1 + i] for i in range(n)), strict=True)
            # Ascending starts: a later occurrence overwrites an earlier one.
            table.update(zip(map(hash, grams), range(lo, hi + 1), strict=True))
