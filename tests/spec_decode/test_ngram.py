"""Prompt lookup: the longest recent n-gram match drafts what followed it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.spec_decode.host import make_host_proposer
from ember.spec_decode.ngram import NgramProposer


def _propose(tokens: list[int], k: int = 8, max_tokens: int | None = None, **kw: int) -> list[int]:
    p = NgramProposer(k, **kw)
    p.add_request("r", tokens, None)
    return p.propose("r", tokens, k if max_tokens is None else max_tokens)


def _reference(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Brute force: longest n first, then the most recent earlier occurrence."""
    n_tok = len(tokens)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        suffix = tokens[n_tok - n :]
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_drafts_what_followed_the_match() -> None:
    assert _propose([10, 11, 12, 13, 14, 99, 10, 11]) == [12, 13, 14, 99, 10, 11]


def test_longest_match_wins_over_a_more_recent_shorter_one() -> None:
    # The 2-gram (7, 8) occurred at 0; the 1-gram (8,) more recently at 4 (followed by 5).
    tokens = [7, 8, 1, 2, 8, 5, 7, 8]
    assert _propose(tokens, k=2) == [1, 2]
    assert _propose(tokens, k=2, max_n=1) == [5, 7]


def test_most_recent_occurrence_wins() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2]
    assert _propose(tokens, k=2) == [4, 9]


def test_max_n_bounds_the_match() -> None:
    # A 5-gram would point at the first copy; with max_n=4 the most recent 4-gram decides.
    tokens = [5, 1, 2, 3, 4, 60, 6, 1, 2, 3, 4, 70, 5, 1, 2, 3, 4]
    assert _propose(tokens, k=1) == [70]
    assert _propose(tokens, k=1, max_n=5) == [60]


def test_min_n_refuses_short_matches() -> None:
    tokens = [1, 2, 3, 4, 3]
    assert _propose(tokens, k=2) == [4, 3]
    assert _propose(tokens, k=2, min_n=2) == []


def test_no_draft_without_an_earlier_occurrence() -> None:
    assert _propose([1, 2, 3, 4, 5]) == []
    assert _propose([7]) == []
    assert _propose([]) == []


def test_max_tokens_and_k_bound_the_draft() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 1]
    assert _propose(tokens, k=8, max_tokens=3) == [2, 3, 4]
    assert _propose(tokens, k=2, max_tokens=8) == [2, 3]
    assert _propose(tokens, k=8, max_tokens=0) == []


def test_draft_stops_at_the_end_of_the_tokens() -> None:
    # The match's continuation runs into the current suffix: fewer than k tokens remain.
    assert _propose([4, 4, 4], k=8) == [4]
    assert _propose([1, 2, 1, 2], k=8) == [1, 2]


def test_incremental_updates_match_a_fresh_index() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]
    p = NgramProposer(4)
    p.add_request("r", tokens[:5], None)
    for end in range(5, len(tokens) + 1):
        draft = p.propose("r", tokens[:end], 4)
        assert draft == _reference(tokens[:end], 4), end
        assert p.propose("r", tokens[:end], 4) == draft  # the same tokens again: no change


def test_catches_up_on_several_tokens_at_once() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 7, 1, 2, 3]
    p = NgramProposer(3)
    p.add_request("r", tokens[:2], None)
    assert p.propose("r", tokens, 3) == _reference(tokens, 3) == [4, 7, 1]


def test_a_changed_prefix_rebuilds_the_index() -> None:
    p = NgramProposer(2)
    p.add_request("r", [1, 2, 3, 1], None)
    assert p.propose("r", [1, 2, 3, 1], 2) == [2, 3]
    assert p.propose("r", [5, 6, 7, 5], 2) == [6, 7]
    assert p.propose("r", [5, 6], 2) == []


def test_finish_frees_the_request() -> None:
    p = NgramProposer(4)
    p.add_request("a", [1, 2, 1], None)
    p.add_request("b", [3, 4, 3], "tenant")
    p.finish("a", [2])
    assert "a" not in p._requests and "b" in p._requests
    with pytest.raises(KeyError, match="never added"):
        p.propose("a", [1, 2, 1, 2], 4)
    p.finish("a", [])  # a second finish is harmless
    assert p.propose("b", [3, 4, 3], 4) == [4, 3]


def test_factory_and_bad_settings() -> None:
    assert isinstance(make_host_proposer("ngram", 4), NgramProposer)
    with pytest.raises(ValueError, match="not a host proposer"):
        make_host_proposer("eagle3", 4)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(4, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="k >= 1"):
        NgramProposer(0)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=60),
    split=st.integers(0, 60),
    k=st.integers(1, 6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_drafts_are_real_continuations(
    tokens: list[int], split: int, k: int, min_n: int, extra: int
) -> None:
    max_n = min_n + extra
    p = NgramProposer(k, min_n=min_n, max_n=max_n)
    p.add_request("r", tokens[:split], None)
    for end in range(min(split, len(tokens)), len(tokens) + 1):
        seen = tokens[:end]
        draft = p.propose("r", seen, k)
        assert draft == _reference(seen, k, min_n, max_n)
        if draft:
            # Some n-gram ending the tokens occurs earlier, followed by exactly the draft.
            assert any(
                seen[s : s + n] == seen[end - n :] and seen[s + n : s + n + len(draft)] == draft
                for n in range(min_n, max_n + 1)
                for s in range(end - n)
            )
