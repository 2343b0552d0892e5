from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ember.kv.block_hash import hash_blocks, root_hash
from ember.router.prefix_index import PrefixIndex

BLOCK = 4
ROOT = root_hash("test-model")


def chain(n_blocks: int, first_token: int = 0) -> list[bytes]:
    return hash_blocks(ROOT, list(range(first_token, first_token + n_blocks * BLOCK)), BLOCK)


def test_match_counts_leading_blocks_per_endpoint() -> None:
    prompt = chain(6)
    idx = PrefixIndex()
    idx.apply("http://a", stored=prompt[:4], removed=[])
    idx.apply("http://b", stored=prompt[:2], removed=[])
    idx.apply("http://c", stored=chain(3, first_token=1000), removed=[])
    assert idx.match(prompt) == {"http://a": 4, "http://b": 2}
    assert idx.match(prompt[:1]) == {"http://a": 1, "http://b": 1}
    assert idx.match([]) == {}


def test_match_stops_at_the_first_missing_block() -> None:
    prompt = chain(6)
    idx = PrefixIndex()
    idx.apply(
        "http://a", stored=[prompt[0], prompt[1], prompt[3], prompt[4], prompt[5]], removed=[]
    )
    idx.apply("http://b", stored=prompt[1:], removed=[])  # everything but the first block
    assert idx.match(prompt) == {"http://a": 2}


def test_removed_blocks_no_longer_match() -> None:
    prompt = chain(5)
    idx = PrefixIndex()
    idx.apply("http://a", stored=prompt, removed=[])
    idx.apply("http://a", stored=[], removed=[prompt[2]])
    assert idx.match(prompt) == {"http://a": 2}
    idx.apply("http://a", stored=[], removed=[prompt[0]])
    assert idx.match(prompt) == {}
    assert idx.num_blocks("http://a") == 3


def test_a_hash_stored_and_removed_in_one_batch_ends_removed() -> None:
    prompt = chain(2)
    idx = PrefixIndex()
    idx.apply("http://a", stored=prompt, removed=[prompt[1]])
    assert idx.match(prompt) == {"http://a": 1}


def test_removing_an_unknown_block_is_harmless() -> None:
    idx = PrefixIndex()
    idx.apply("http://a", stored=[], removed=chain(3))
    assert len(idx) == 0 and idx.num_blocks("http://a") == 0


def test_forget_drops_only_that_endpoint() -> None:
    prompt = chain(4)
    idx = PrefixIndex()
    idx.apply("http://a", stored=prompt, removed=[])
    idx.apply("http://b", stored=prompt[:3] + chain(2, first_token=500), removed=[])
    idx.forget("http://a")
    assert idx.match(prompt) == {"http://b": 3}
    assert idx.num_blocks("http://a") == 0
    idx.forget("http://b")
    assert len(idx) == 0 and idx.match(prompt) == {}
    idx.forget("http://never-seen")


def test_thousands_of_blocks_across_endpoints() -> None:
    long = chain(5000)
    idx = PrefixIndex()
    idx.apply("http://a", stored=long, removed=[])
    idx.apply("http://b", stored=long[:3000], removed=[])
    idx.apply("http://c", stored=long[:4000], removed=[long[1234]])
    assert idx.match(long) == {"http://a": 5000, "http://b": 3000, "http://c": 1234}
    assert len(idx) == 5000


@given(
    held=st.dictionaries(
        st.sampled_from(["http://a", "http://b", "http://c"]),
        st.sets(st.integers(0, 11)),
    ),
    removed=st.sets(st.integers(0, 11)),
    length=st.integers(0, 12),
)
def test_match_agrees_with_a_brute_force_walk(
    held: dict[str, set[int]], removed: set[int], length: int
) -> None:
    blocks = chain(12)
    idx = PrefixIndex()
    for url, ids in held.items():
        idx.apply(url, stored=[blocks[i] for i in sorted(ids)], removed=[])
    # "http://a" also evicts some blocks
    idx.apply("http://a", stored=[], removed=[blocks[i] for i in removed])
    holds = {u: set(ids) - (removed if u == "http://a" else set()) for u, ids in held.items()}

    expected: dict[str, int] = {}
    for url, ids in holds.items():
        n = 0
        while n < length and n in ids:
            n += 1
        if n:
            expected[url] = n
    assert idx.match(blocks[:length]) == expected
    assert len(idx) == len(set[int]().union(*holds.values()))
