"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; ArcticInference's "suffix" method): drafts
from a suffix tree over the request's own tokens and one over its tenant's recent answers."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ember.spec_decode.proposer import HostProposer
from ember.spec_decode.suffix_draft import speculate, speculate_open
from ember.spec_decode.suffix_tree import SuffixTree

_OWN = 0  # the one sequence of a request's own tree


@dataclass(slots=True)
class _Request:
    scope: str | None
    tree: SuffixTree
    """The request's prompt and output so far, one open sequence."""
    score: float = 0.0
    """The last proposal's score: the expected number of its tokens that stand."""


@dataclass(slots=True)
class _ScopeCache:
    """One scope's recent outputs in one tree, oldest first (evicted first)."""

    tree: SuffixTree
    outputs: OrderedDict[int, int] = field(default_factory=OrderedDict)
    """Sequence id -> its number of tokens."""
    num_tokens: int = 0
    next_id: int = 0

    def add(self, output: list[int]) -> None:
        self.tree.insert(self.next_id, output)
        self.outputs[self.next_id] = len(output)
        self.num_tokens += len(output)
        self.next_id += 1

    def evict_oldest(self) -> int:
        """Drop the oldest output; returns its number of tokens."""
        seq_id, n = self.outputs.popitem(last=False)
        self.tree.remove(seq_id)
        self.num_tokens -= n
        return n


class SuffixProposer(HostProposer):
    """Greedy drafts from two bounded-depth suffix trees, the better of the two per step.

    Per request, a tree over its prompt and output grows by one token per decoded token
    (O(max_depth) steps; a suffix that runs alone into a leaf costs nothing). Per scope, a tree
    holds the outputs of that scope's most recently finished requests: at most
    `max_cached_requests` per scope (the first finished goes first), `max_scopes` scopes (the
    least recently used goes) and `max_cached_tokens` tokens in all (about 200 bytes each). A
    request reads only its own scope's tree, so one tenant's answers never reach another
    tenant's drafts.

    To propose, each tree matches the longest suffix of the request's tokens (up to
    max_depth - 1), then for each match length m follows the most frequent continuation while
    the path's probability (product of child count / parent count) stays >= min_token_prob, for
    at most min(max_tokens, max_spec_factor * m + max_spec_offset) tokens; the draft with the
    highest score (sum of its tokens' probabilities: the expected number accepted) wins.
    """

    def __init__(
        self,
        k: int,
        max_depth: int = 24,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        max_cached_requests: int = 256,
        max_scopes: int = 64,
        max_cached_tokens: int = 1 << 19,
    ) -> None:
        if k < 1:
            raise ValueError(f"suffix proposer needs k >= 1, got {k}")
        if max_depth < 2:
            raise ValueError(f"suffix tree depth must be >= 2, got {max_depth}")
        if max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {max_spec_factor}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        if min(max_cached_requests, max_scopes, max_cached_tokens) < 0:
            raise ValueError("suffix proposer cache bounds must be >= 0")
        self.k = k
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.max_cached_requests = max_cached_requests
        self.max_scopes = max_scopes
        self.max_cached_tokens = max_cached_tokens
        self._requests: dict[str, _Request] = {}
        self._scopes: OrderedDict[str | None, _ScopeCache] = OrderedDict()
        self._cached_tokens = 0

    # ---- HostProposer --------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Sequence[int], scope: str | None) -> None:
        # The prompt goes into the request's tree at its first propose (`_sync`), not here: a
        # request the engine never speculates for costs nothing (~5 ms for a 3k-token prompt).
        tree = SuffixTree(self.max_depth)
        tree.append(_OWN, [])
        self._requests[request_id] = _Request(scope, tree)
        if scope in self._scopes:
            self._scopes.move_to_end(scope)

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> list[int]:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"suffix proposer: request {request_id!r} was never added")
        self._sync(req, tokens)
        limit = min(max_tokens, self.k)
        if limit <= 0:
            return []
        settings = (limit, self.max_spec_factor, self.max_spec_offset, self.min_token_prob)
        best = speculate_open(req.tree, *settings)
        cache = self._scopes.get(req.scope)
        if cache is not None:
            self._scopes.move_to_end(req.scope)
            shared = speculate(cache.tree, req.tree.tokens(_OWN), *settings)
            if shared.score > best.score:
                best = shared
        req.score = best.score
        return best.tokens

    def expected_accepted(self, request_id: str) -> float | None:
        req = self._requests.get(request_id)
        return None if req is None else req.score

    def finish(self, request_id: str, output: Sequence[int]) -> None:
        req = self._requests.pop(request_id, None)
        if req is None or not output:
            return
        if self.max_cached_requests == 0 or self.max_scopes == 0:
            return
        if len(output) > self.max_cached_tokens:
            return  # it alone would flush the whole cache
        cache = self._scopes.get(req.scope)
        if cache is None:
            cache = self._scopes[req.scope] = _ScopeCache(SuffixTree(self.max_depth))
        self._scopes.move_to_end(req.scope)
        cache.add(list(output))
        self._cached_tokens += len(output)
        while len(cache.outputs) > self.max_cached_requests:
            self._cached_tokens -= cache.evict_oldest()
        while len(self._scopes) > self.max_scopes:
            _, dropped = self._scopes.popitem(last=False)
            self._cached_tokens -= dropped.num_tokens
        while self._cached_tokens > self.max_cached_tokens:
            self._evict_least_recent()

    # ---- helpers -------------------------------------------------------------------------

    def cached_outputs(self, scope: str | None) -> int:
        """How many finished outputs of `scope` are cached (for tests and metrics)."""
        cache = self._scopes.get(scope)
        return 0 if cache is None else len(cache.outputs)

    def _sync(self, req: _Request, tokens: Sequence[int]) -> None:
        """Append the tokens that arrived since the last call. A shorter or different sequence
        (checked on the last token held only, to stay O(1)) rebuilds the request's tree."""
        held = req.tree.tokens(_OWN)
        n = len(held)
        if len(tokens) < n or (n and tokens[n - 1] != held[n - 1]):
            req.tree = SuffixTree(self.max_depth)
            req.tree.append(_OWN, tokens)
        elif len(tokens) > n:
            req.tree.append(_OWN, tokens[n:])

    def _evict_least_recent(self) -> None:
        """One output out of the least recently used scope (the scope goes once empty)."""
        scope, cache = next(iter(self._scopes.items()))
        self._cached_tokens -= cache.evict_oldest()
        if not cache.outputs:
            del self._scopes[scope]
