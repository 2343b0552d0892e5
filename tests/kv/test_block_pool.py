import pytest

from ember.kv.block_pool import BlockPool, KVCacheError


def test_allocate_free_and_lru_eviction_order() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    assert pool.num_free_blocks == 2
    pool.free([a, b])  # one request's blocks: b, the deeper, first in the eviction order
    assert pool.num_free_blocks == 4
    assert pool.get_cached_block(b"ha") is a  # freed blocks stay findable
    # The never-used blocks come first, then b, then a.
    got = pool.allocate(3)
    assert got[-1] is b
    assert pool.get_cached_block(b"hb") is None  # evicted on reuse
    assert pool.get_cached_block(b"ha") is a
    assert pool.num_evictions == 1


def test_touch_takes_hits_out_of_the_free_queue() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"h")
    pool.free([a])
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    with pytest.raises(KVCacheError, match="asked for 2 blocks"):
        pool.allocate(2)


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(KVCacheError, match="double free of block 0"):
        pool.free([a])


def test_duplicate_content_keeps_first_writer() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h")
    pool.cache_block(b, b"h")
    assert pool.get_cached_block(b"h") is a
    pool.free([a, b])
    pool.allocate(2)  # the unused block, then b (its duplicate, uncached): a keeps the hash
    assert pool.get_cached_block(b"h") is a
    pool.allocate(1)  # then a: evicting it drops the hash
    assert pool.get_cached_block(b"h") is None


def test_caching_disabled_finds_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"h")
    assert pool.get_cached_block(b"h") is None
