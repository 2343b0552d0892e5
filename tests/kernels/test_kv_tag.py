"""The NH kernel under the KV transfer tags against its NumPy reference, on fresh random blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.kernels.kv_tag import CHUNK_PAIRS, SMALL_STEPS, STEPS, nh_sums, nh_sums_reference

ONE_PROGRAM = 2 * CHUNK_PAIRS * SMALL_STEPS
"""Words one program sums."""


@pytest.mark.parametrize(
    "words_per_block", [8, 2 * CHUNK_PAIRS + 6, ONE_PROGRAM, 2 * ONE_PROGRAM + 2 * CHUNK_PAIRS + 2]
)
@pytest.mark.parametrize("steps", [None, STEPS])
def test_nh_matches_the_reference(device: str, words_per_block: int, steps: int | None) -> None:
    g = np.random.default_rng(words_per_block)
    data = g.integers(0, 2**32, (7, words_per_block), dtype=np.uint32)
    data[0] = 0xFFFFFFFF  # every sum and product at its largest: wrap-around checked
    key = g.integers(0, 2**32, words_per_block + 2, dtype=np.uint32)
    key[: words_per_block // 2] = 0xFFFFFFFF
    ids = [6, 0, 3, 3]
    words = torch.from_numpy(data.view(np.int32)).to(device)
    got = nh_sums(
        words,
        torch.from_numpy(key.view(np.int32)).to(device),
        torch.tensor(ids, dtype=torch.int64, device=device),
        steps=steps,
    )
    assert got.dtype == np.uint64
    np.testing.assert_array_equal(got, nh_sums_reference(data[ids], key))


def test_one_changed_word_changes_both_lanes() -> None:
    g = np.random.default_rng(0)
    data = g.integers(0, 2**32, (2, 64), dtype=np.uint32)
    data[1] = data[0]
    data[1, 17] ^= 1
    key = g.integers(0, 2**32, 66, dtype=np.uint32)
    sums = nh_sums_reference(data, key)
    assert (sums[0] != sums[1]).all()
