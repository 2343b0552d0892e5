"""The collectives over gloo in 2 and 4 processes, and the shard arithmetic."""

from __future__ import annotations

import pytest
import torch

from ember.distributed import comm, state
from ember.distributed.shard import shard_heads, shard_range
from tests.distributed.ranks import run_ranks


def _collectives() -> dict[str, torch.Tensor | int]:
    s = state.current()
    x = torch.full((2, 3), float(s.rank + 1))
    reduced = comm.all_reduce(x.clone())
    gathered = comm.all_gather(torch.arange(2.0).view(2, 1) + 10 * s.rank, dim=-1)
    b = comm.broadcast(torch.tensor([s.rank * 7 + 1]), src=0)
    return {
        "reduced": reduced,
        "gathered": gathered,
        "b": b,
        "min": comm.all_reduce_min(5 + s.rank),
    }


@pytest.mark.parametrize("size", [2, 4])
def test_collectives_over_gloo(size: int) -> None:
    results = run_ranks(size, _collectives)
    total = sum(range(1, size + 1))
    for r in results:
        assert torch.equal(r["reduced"], torch.full((2, 3), float(total)))
        want = torch.cat([torch.arange(2.0).view(2, 1) + 10 * k for k in range(size)], dim=-1)
        assert torch.equal(r["gathered"], want)
        assert r["b"].item() == 1 and r["min"] == 5


def test_one_rank_is_the_identity() -> None:
    x = torch.randn(3, 4)
    assert comm.all_reduce(x) is x
    assert comm.all_gather(x) is x
    assert comm.all_reduce_min(9) == 9


def test_shards() -> None:
    assert shard_range(12, 2, 4, "x") == (6, 9)
    with pytest.raises(ValueError, match="intermediate_size \\(10\\) is not divisible"):
        shard_range(10, 0, 4, "intermediate_size")
    # 4 query heads, 2 KV heads over 4 ranks: each KV head on two ranks.
    assert [shard_heads(4, 2, r, 4).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    assert shard_heads(8, 4, 1, 2).kv_head_start == 2 and shard_heads(8, 4, 1, 2).num_kv_heads == 2
    with pytest.raises(ValueError, match="num_key_value_heads \\(3\\) must divide"):
        shard_heads(12, 3, 0, 4)
