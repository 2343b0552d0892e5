"""Suffix decoding: the suffix tree's counts, greedy drafts, adaptive length and the per-scope
cache of finished outputs (isolation and eviction)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.spec_decode.host import make_host_proposer
from ember.spec_decode.suffix import SuffixProposer
from ember.spec_decode.suffix_draft import speculate_open
from ember.spec_decode.suffix_tree import SuffixTree

# ---- the tree ------------------------------------------------------------------------------


def _occurrences(seqs: list[list[int]], pattern: list[int]) -> int:
    m = len(pattern)
    return sum(s[i : i + m] == pattern for s in seqs for i in range(len(s) - m + 1))


def _check_structure(tree: SuffixTree) -> None:
    """Counts cover the children, unary chains are merged, edges and cached tops are right,
    and freed nodes are unreachable."""
    count, children_of, top = tree._count, tree._children, tree._top
    seen = set()
    stack = [0]
    while stack:
        node = stack.pop()
        seen.add(node)
        children = children_of[node] or {}
        assert count[node] >= sum(count[c] for c in children.values())
        if node != 0:
            assert count[node] > 0 and tree._edge_len(node) > 0
            if len(children) == 1:
                assert count[next(iter(children.values()))] < count[node], "unmerged chain"
        if top[node] != -1:
            assert count[top[node]] == max(count[c] for c in children.values())
        for token, child in children.items():
            assert tree._parent[child] == node
            assert tree._seq[child][tree._start[child]] == token
            stack.append(child)
    assert not seen & set(tree._free)
    assert len(seen) == tree.num_nodes


def _check_counts(tree: SuffixTree, seqs: list[list[int]], depth: int) -> None:
    for s in seqs:
        for i in range(len(s)):
            for m in range(1, min(depth, len(s) - i) + 1):
                assert tree.count(s[i : i + m]) == _occurrences(seqs, s[i : i + m])
    assert tree.count([99]) == 0


_SEQ = st.lists(st.integers(0, 2), max_size=14)


@settings(max_examples=150, deadline=None)
@given(
    depth=st.integers(2, 6),
    ops=st.lists(st.tuples(st.booleans(), _SEQ, st.integers(0, 10)), max_size=8),
    tail=_SEQ,
)
def test_tree_counts_every_pattern_through_inserts_and_removals(
    depth: int, ops: list[tuple[bool, list[int], int]], tail: list[int]
) -> None:
    tree = SuffixTree(depth)
    live: dict[int, list[int]] = {}
    for seq_id, (remove, tokens, pick) in enumerate(ops):
        if remove and live:
            victim = sorted(live)[pick % len(live)]
            tree.remove(victim)
            del live[victim]
        else:
            tree.insert(seq_id, tokens)
            live[seq_id] = tokens
        _check_structure(tree)
        _check_counts(tree, list(live.values()), depth)
    # An open sequence, one token at a time, on top of the closed ones: a suffix part way
    # along an edge is not counted there yet, but every pattern that occurs is found.
    grown: list[int] = []
    tree.append(100, [])
    seqs = [*live.values(), grown]
    for token in tail:
        grown.append(token)
        tree.append(100, [token])
        _check_structure(tree)
        for s in seqs:
            for i in range(len(s)):
                for m in range(1, min(depth, len(s) - i) + 1):
                    assert 1 <= tree.count(s[i : i + m]) <= _occurrences(seqs, s[i : i + m])
    tree.close()
    _check_structure(tree)
    _check_counts(tree, seqs, depth)


def test_tree_rules() -> None:
    tree = SuffixTree(4)
    tree.append(1, [1, 2])
    with pytest.raises(ValueError, match="still open"):
        tree.append(2, [3])
    with pytest.raises(RuntimeError, match="closed"):
        tree.remove(1)
    tree.close()
    with pytest.raises(ValueError, match="closed"):
        tree.append(1, [3])
    with pytest.raises(ValueError, match="already present"):
        tree.insert(1, [3])
    with pytest.raises(ValueError, match="depth"):
        SuffixTree(1)


def test_counts_stop_at_max_depth() -> None:
    tree = SuffixTree(3)
    tree.insert(0, [1, 2, 3, 4, 1, 2, 3, 4])
    assert tree.count([1, 2, 3]) == 2
    assert tree.count([1, 2, 3, 4]) == 0  # longer than the depth: not stored


# ---- drafts from the request's own tokens ----------------------------------------------------


def _propose(tokens: list[int], k: int = 8, max_tokens: int | None = None, **kw) -> list[int]:
    p = SuffixProposer(k, **kw)
    p.add_request("r", tokens, None)
    return p.propose("r", tokens, k if max_tokens is None else max_tokens)


def test_drafts_what_followed_the_match() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    assert _propose(tokens) == [4, 5, 6]  # matched 3 tokens: at most 3 drafted


def test_a_longer_match_beats_a_more_frequent_shorter_one() -> None:
    # "2 3" went on with 60 twice and 50 once, but "1 2 3" only ever with 50.
    tokens = [1, 2, 3, 50, 9, 2, 3, 60, 9, 2, 3, 60, 9, 1, 2, 3]
    assert _propose(tokens) == [50, 9, 2]
    assert _propose(tokens[1:]) == [60, 9]  # without the leading 1, "2 3" is all there is


def test_draft_length_adapts_to_the_match_length() -> None:
    tokens = [5, 6, 7, 8, 5]  # only "5" recurs
    assert _propose(tokens) == [6]
    assert _propose(tokens, max_spec_factor=3.0) == [6, 7, 8]
    assert _propose(tokens, max_spec_offset=1.0) == [6, 7]
    assert _propose(tokens, max_spec_factor=0.5) == []
    assert _propose([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], max_spec_factor=2.0) == [4, 5, 6, 9, 1, 2]


def test_max_tokens_and_k_bound_the_draft() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    kw = {"max_spec_factor": 4.0}
    assert _propose(tokens, k=8, **kw) == [4, 5, 6, 9, 1, 2, 3]  # then the end of the tokens
    assert _propose(tokens, k=8, max_tokens=2, **kw) == [4, 5]
    assert _propose(tokens, k=3, **kw) == [4, 5, 6]
    assert _propose(tokens, k=8, max_tokens=0, **kw) == []


def test_no_draft_when_only_the_current_suffix_matches() -> None:
    assert _propose([1, 2, 3, 4]) == []
    assert _propose([]) == []
    assert _propose([4, 4]) == [4]


# "7 8" is followed by 1 three times and by 2 once; "7 8 1" by 50 twice and by 51 once.
_BRANCHY = [7, 8, 1, 50, 60, 7, 8, 1, 50, 61, 7, 8, 1, 51, 62, 7, 8, 2, 63, 7, 8]


def test_greedy_walk_takes_the_most_frequent_continuation_with_its_probability() -> None:
    tree = SuffixTree(24)
    tree.append(0, _BRANCHY)
    draft = speculate_open(tree, 8, 1.0, 0.0, 0.1)
    assert draft.tokens == [1, 50]
    assert draft.probs == pytest.approx([3 / 4, 3 / 4 * 2 / 3])
    assert draft.score == pytest.approx(3 / 4 + 1 / 2)
    assert draft.match_len == 2


def test_probability_cut_off() -> None:
    assert _propose(_BRANCHY, min_token_prob=0.4) == [1, 50]
    assert _propose(_BRANCHY, min_token_prob=0.6) == [1]
    assert _propose(_BRANCHY, min_token_prob=0.8) == []


def test_tokens_arrive_incrementally_and_a_changed_prefix_rebuilds() -> None:
    p = SuffixProposer(8)
    p.add_request("r", [1, 2, 3], None)
    assert p.propose("r", [1, 2, 3], 8) == []
    assert p.propose("r", [1, 2, 3, 4, 1, 2], 8) == [3, 4]
    assert p.propose("r", [1, 2, 3, 4, 1, 2], 8) == [3, 4]  # the same tokens again
    assert p.propose("r", [1, 2, 3, 4, 1, 2, 3], 8) == [4, 1, 2]
    assert p.propose("r", [9, 8, 9], 8) == [8]  # not an extension: start over


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=50), k=st.integers(1, 8))
def test_own_drafts_are_real_continuations(tokens: list[int], k: int) -> None:
    tree = SuffixTree(6)
    tree.append(0, tokens)
    draft = speculate_open(tree, k, 1.0, 0.0, 0.1)
    m, n = draft.match_len, len(tokens)
    assert len(draft.tokens) <= min(k, m)
    if draft.tokens:
        assert any(
            tokens[s : s + m] == tokens[n - m :]
            and tokens[s + m : s + m + len(draft.tokens)] == draft.tokens
            for s in range(n - m)
        )
        assert all(0.1 <= q <= 1.0 for q in draft.probs)
        assert draft.score == pytest.approx(sum(draft.probs))


# ---- drafts from earlier answers of the same scope -----------------------------------------

_ANSWER = [40, 41, 42, 43, 44, 45, 46, 47]


def _ask(p: SuffixProposer, rid: str, scope: str | None, tokens: list[int]) -> list[int]:
    p.add_request(rid, tokens, scope)
    draft = p.propose(rid, tokens, 8)
    p.finish(rid, [])
    return draft


def test_drafts_from_an_earlier_answer_of_the_same_scope_only() -> None:
    p = SuffixProposer(8)
    p.add_request("first", [1, 2, 3], "alice")
    p.finish("first", _ANSWER)
    assert p.cached_outputs("alice") == 1
    context = [9, 9, 40, 41, 42, 43]  # quotes the start of alice's answer
    assert _ask(p, "same", "alice", context) == [44, 45, 46, 47]
    assert _ask(p, "other", "bob", context) == []
    assert _ask(p, "default", None, context) == []
    # Empty answers (and the prompt) are never cached.
    assert p.cached_outputs("bob") == 0 and p.cached_outputs(None) == 0


def test_the_better_scoring_tree_wins() -> None:
    # Own tokens: "7 8" -> 1 (2 of 3), then 90; the scope's answer: "7 8" -> 3 4, always.
    own = [7, 8, 1, 90, 7, 8, 1, 90, 7, 8, 2, 92, 7, 8]
    p = SuffixProposer(8)
    assert _ask(p, "a", "t", own) == [1, 90]
    p.add_request("b", [0], "t")
    p.finish("b", [7, 8, 3, 4])
    assert _ask(p, "c", "t", own) == [3, 4]


def test_lru_eviction_removes_an_answer_from_the_tree() -> None:
    p = SuffixProposer(8, max_cached_requests=2)
    answers = {f"r{i}": [100 * (i + 1) + j for j in range(6)] for i in range(3)}
    for rid, answer in answers.items():
        p.add_request(rid, [0], "t")
        p.finish(rid, answer)
    assert p.cached_outputs("t") == 2
    tree = p._scopes["t"].tree
    assert tree.count(answers["r0"][:3]) == 0  # evicted: its suffixes are gone
    assert tree.count(answers["r1"][:3]) == 1
    assert _ask(p, "q0", "t", answers["r0"][:3]) == []
    assert _ask(p, "q1", "t", answers["r1"][:3]) == answers["r1"][3:6]


def test_scope_bound_drops_the_least_recently_used_scope() -> None:
    p = SuffixProposer(8, max_scopes=2)
    for scope in ("a", "b"):
        p.add_request(scope, [0], scope)
        p.finish(scope, _ANSWER)
    _ask(p, "touch", "a", [1, 2])  # "a" used again: "b" is now the least recent
    p.add_request("c", [0], "c")
    p.finish("c", _ANSWER)
    assert [p.cached_outputs(s) for s in ("a", "b", "c")] == [1, 0, 1]


def test_token_budget_evicts_oldest_answers_first() -> None:
    p = SuffixProposer(8, max_cached_tokens=12)
    for i, scope in enumerate(("a", "b", "a")):
        p.add_request(str(i), [0], scope)
        p.finish(str(i), [10 * i + j for j in range(5)])
    # 15 tokens > 12: the oldest answer of the least recently used scope ("b") goes.
    assert [p.cached_outputs(s) for s in ("a", "b")] == [2, 0]
    assert p._cached_tokens == 10
    p.add_request("big", [0], "a")
    p.finish("big", list(range(13)))  # larger than the whole budget: not cached
    assert p.cached_outputs("a") == 2


def test_finish_frees_the_request() -> None:
    p = SuffixProposer(8)
    p.add_request("a", [1, 2, 1], "t")
    p.finish("a", [2, 1])
    assert p._requests == {}
    with pytest.raises(KeyError, match="never added"):
        p.propose("a", [1, 2, 1], 8)
    p.finish("a", [5, 6])  # unknown now: ignored, nothing cached twice
    assert p.cached_outputs("t") == 1


def test_factory_and_bad_settings() -> None:
    assert isinstance(make_host_proposer("suffix", 4), SuffixProposer)
    with pytest.raises(ValueError, match="not a host proposer"):
        make_host_proposer("nope", 4)
    with pytest.raises(ValueError, match="min_token_prob"):
        SuffixProposer(4, min_token_prob=2.0)
    with pytest.raises(ValueError, match="k >= 1"):
        SuffixProposer(0)
