"""Drafts from a suffix tree (SuffixDecoding, arXiv 2411.04975): over every length of the context's
matched suffix, the greedy continuation of highest score, where a token's probability is the
product of child count / parent count along its path. The walk reads the tree's node arrays
directly, since it runs for every request at every step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ember.spec_decode.suffix_tree import _NONE, SuffixTree


@dataclass(slots=True)
class Draft:
    """A greedy continuation: its tokens, their estimated probabilities (products along the
    path), their sum (the expected number of accepted tokens) and the pattern length matched."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


def speculate(
    tree: SuffixTree,
    context: Sequence[int],
    max_tokens: int,
    max_spec_factor: float,
    max_spec_offset: float,
    min_token_prob: float,
) -> Draft:
    """The best greedy draft to follow `context`, over all lengths of its matched suffix.

    For match length m the draft holds at most min(max_tokens, m * factor + offset) tokens;
    the draft of highest score wins, the longer match on a tie.
    """
    context = list(context[-tree.max_depth :])
    settings = (max_tokens, max_spec_factor, max_spec_offset, min_token_prob)
    return _speculate(tree, context, *settings, own=False)


def speculate_open(
    tree: SuffixTree,
    max_tokens: int,
    max_spec_factor: float,
    max_spec_offset: float,
    min_token_prob: float,
) -> Draft:
    """`speculate` for the open sequence's own continuation: its latest occurrence of each
    matched suffix (itself) is left out of the counts, as it has no continuation yet."""
    if tree._open_id is None:
        raise ValueError("suffix tree: no open sequence")
    context = tree._seqs[tree._open_id][-tree.max_depth :]
    settings = (max_tokens, max_spec_factor, max_spec_offset, min_token_prob)
    return _speculate(tree, context, *settings, own=True)


def _speculate(
    tree: SuffixTree,
    context: list[int],
    max_tokens: int,
    max_spec_factor: float,
    max_spec_offset: float,
    min_token_prob: float,
    own: bool,
) -> Draft:
    best = Draft()
    n = len(context)
    # own: the context is the open sequence; its own occurrence of a pattern is no evidence.
    own_counted = tree._own_counted if own else _not_counted
    # A suffix of a pattern occurs at least as often as the pattern, so the lengths that
    # occur (apart from the context's own occurrence) are 1..longest: binary search.
    longest, absent = 0, min(n, tree.max_depth - 1) + 1
    while absent - longest > 1:
        mid = (longest + absent) // 2
        hit = tree.match(context[n - mid :])
        if hit is None or tree._count[hit[0]] <= own_counted(mid):
            absent = mid
        else:
            longest = mid
    # A match of m tokens leaves room for max_depth - m more. Try first the longest match
    # with room for max_tokens: when its draft is certain, no other can score higher.
    depth = tree.max_depth
    first = min(longest, depth - max_tokens)
    lengths: Sequence[int] = range(longest, 0, -1)
    if 0 < first < longest:
        lengths = (first, *(m for m in lengths if m != first))
    for m in lengths:
        cap = min(max_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6))
        if cap <= best.score:
            break  # shorter matches: a draft of at most `cap` tokens cannot score higher
        if depth - m <= best.score:
            continue  # no room left below this match for a better draft
        node, idx = tree.match(context[n - m :])  # type: ignore[misc]
        draft = _walk(tree, node, idx, cap, min_token_prob, own_counted(m))
        if draft.score > best.score:
            draft.match_len = m
            best = draft
    return best


def _walk(
    tree: SuffixTree, node: int, idx: int, cap: int, min_token_prob: float, discount: int
) -> Draft:
    """Follow the most frequent continuation while its probability stays >= min_token_prob.
    `discount`: occurrences counted at the start that continue nowhere (the context's own)."""
    count, children_of, top = tree._count, tree._children, tree._top
    draft = Draft()
    tokens = draft.tokens
    probs = draft.probs
    prob = 1.0
    node_len = tree._edge_len(node)
    while len(tokens) < cap:
        if idx < node_len:
            # The rest of an edge: every occurrence here goes on the same way.
            take = min(node_len - idx, cap - len(tokens))
            at = tree._start[node] + idx
            tokens.extend(tree._seq[node][at : at + take])
            probs.extend([prob] * take)
            idx += take
            continue
        children = children_of[node]
        if not children:
            break
        best = top[node]
        if best == _NONE:
            best = top[node] = max(children.values(), key=count.__getitem__)
        total = count[node] - discount
        discount = 0
        if total <= 0:
            break
        prob *= count[best] / total
        if prob < min_token_prob:
            break
        node = best
        node_len = tree._edge_len(node)
        idx = 0
    draft.score = sum(probs)
    return draft


def _not_counted(length: int) -> int:
    return 0
