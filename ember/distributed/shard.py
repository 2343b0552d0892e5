"""How a dimension splits across the ranks: contiguous equal slices, rank r holding the r-th.
A size the ranks do not divide is refused when the model is built, naming the dimension."""

from __future__ import annotations

from dataclasses import dataclass


def shard_size(total: int, size: int, what: str) -> int:
    """`total` / `size`, or a clear error when the ranks do not divide it."""
    if total % size:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({size})")
    return total // size


def shard_range(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """[start, end) of rank `rank`'s slice of `total`."""
    n = shard_size(total, size, what)
    return rank * n, (rank + 1) * n


@dataclass(frozen=True, slots=True)
class HeadShard:
    """A rank's attention heads: `num_heads` query heads starting at `head_start`, and
    `num_kv_heads` KV heads starting at `kv_head_start`. With fewer KV heads than ranks, each
    KV head is held (replicated) by size / num_kv_heads ranks: the ones whose query heads use it."""

    num_heads: int
    head_start: int
    num_kv_heads: int
    kv_head_start: int


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    q = shard_size(num_heads, size, "num_attention_heads")
    if num_kv_heads >= size:
        kv = shard_size(num_kv_heads, size, "num_key_value_heads")
        return HeadShard(q, rank * q, kv, rank * kv)
    if size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) must divide the "
            f"tensor-parallel size ({size}) when it is smaller"
        )
    per_kv = size // num_kv_heads  # ranks sharing one KV head
    return HeadShard(q, rank * q, 1, rank // per_kv)
