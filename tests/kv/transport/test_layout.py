from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ember.kv.transport import block_regions, pair_regions

BASE = 1 << 20
block_ids = st.lists(st.integers(0, 63), max_size=40)


def _bytes_of(regions: list[tuple[int, int]]) -> list[int]:
    return [a for addr, n in regions for a in range(addr, addr + n)]


@given(ids=block_ids, block_bytes=st.integers(1, 16))
def test_block_regions_cover_the_listed_blocks_in_order(ids: list[int], block_bytes: int) -> None:
    regions = block_regions(BASE, block_bytes, ids)
    want = [BASE + b * block_bytes + i for b in ids for i in range(block_bytes)]
    assert _bytes_of(regions) == want
    # Merged as far as possible: no region ends where the next one starts.
    assert all(a + n != b for (a, n), (b, _) in zip(regions, regions[1:], strict=False))
    assert len(regions) == sum(1 for i, b in enumerate(ids) if i == 0 or b != ids[i - 1] + 1)


@given(pairs=st.lists(st.tuples(st.integers(0, 63), st.integers(0, 63)), max_size=40))
def test_pair_regions_send_each_block_to_its_destination(pairs: list[tuple[int, int]]) -> None:
    block_bytes, dst_base = 4, 1 << 30
    src_ids = [s for s, _ in pairs]
    dst_ids = [d for _, d in pairs]
    srcs, dsts, lens = pair_regions(BASE, dst_base, block_bytes, src_ids, dst_ids)
    moved = [(s + i, d + i) for s, d, n in zip(srcs, dsts, lens, strict=True) for i in range(n)]
    want = [
        (BASE + s * block_bytes + i, dst_base + d * block_bytes + i)
        for s, d in pairs
        for i in range(block_bytes)
    ]
    assert moved == want
    runs = sum(
        1
        for i, (s, d) in enumerate(pairs)
        if i == 0 or (s, d) != (pairs[i - 1][0] + 1, pairs[i - 1][1] + 1)
    )
    assert len(lens) == runs


def test_regions_of_a_real_cache_hold_exactly_those_blocks() -> None:
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], block-major.
    kv = torch.randn(16, 3, 2, 4, 2, 8)
    block_bytes = kv[0].numel() * kv.element_size()
    flat = kv.view(-1).view(torch.uint8)
    ids = [2, 3, 4, 9, 0, 1]
    regions = block_regions(kv.data_ptr(), block_bytes, ids)
    assert [n // block_bytes for _, n in regions] == [3, 1, 2]
    got = torch.cat([flat[a - kv.data_ptr() : a - kv.data_ptr() + n] for a, n in regions])
    assert torch.equal(got.view(torch.float32).view(len(ids), *kv.shape[1:]), kv[ids])


def test_pair_regions_split_where_only_one_side_runs_on() -> None:
    srcs, dsts, lens = pair_regions(0, 1000, 10, [1, 2, 3, 4], [5, 6, 8, 9])
    assert (srcs, dsts, lens) == ([10, 30], [1050, 1080], [20, 20])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="2 source blocks but 1"):
        pair_regions(0, 0, 8, [0, 1], [0])
    with pytest.raises(ValueError, match="block_bytes"):
        block_regions(0, 0, [1])
    with pytest.raises(ValueError, match="negative"):
        block_regions(0, 8, [-1])
