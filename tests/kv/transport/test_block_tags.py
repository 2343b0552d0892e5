"""Keyed tags of transferred KV blocks: they verify only the same bytes, under the same secret,
lease and place in it, in either scheme."""

from __future__ import annotations

import pytest
import torch

from ember.kv.transport.block_tags import BlockTagger

SHAPE = (8, 2, 2, 4, 2, 8)  # [blocks, layers, K/V, block size, heads, head dim]


def cache(seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme", ["b2", "nh"])
def test_tags_verify_the_same_bytes_and_nothing_else(scheme: str) -> None:
    src, dst = cache(1), cache(1)
    sender, receiver = BlockTagger("s3cret", src), BlockTagger("s3cret", dst)
    ids = [5, 0, 3, 7, 1]
    tags = sender.tags(ids, "engine:req-1", scheme=scheme)
    assert all(t.startswith(f"{scheme}:") for t in tags) and len(set(tags)) == len(tags)
    assert receiver.verify(ids, "engine:req-1", tags)
    # The tail of a lease, as a decode engine that holds its first blocks checks it.
    assert receiver.verify(ids[2:], "engine:req-1", tags[2:], first=2)
    assert not receiver.verify(ids[2:], "engine:req-1", tags[2:])  # places shifted
    assert not receiver.verify(ids, "engine:req-2", tags)  # another lease
    assert not receiver.verify([0, 5, 3, 7, 1], "engine:req-1", tags)  # two blocks swapped
    assert not BlockTagger("other", dst).verify(ids, "engine:req-1", tags)  # another secret
    dst[3, 1, 0, 2, 1, 5] += 1e-3  # one value of block 3
    assert not receiver.verify(ids, "engine:req-1", tags)
    assert not receiver.verify(ids, "engine:req-1", tags[:-1])
    assert not receiver.verify(ids, "engine:req-1", ["xx:" + t[3:] for t in tags])


def test_a_cache_in_host_memory_tags_with_blake2b() -> None:
    assert BlockTagger("s", cache()).scheme == "b2"
    with pytest.raises(ValueError, match="secret"):
        BlockTagger("", cache())
    with pytest.raises(ValueError, match="outside"):
        BlockTagger("s", cache()).tags([8], "l")
