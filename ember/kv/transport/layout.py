"""Where a KV block's bytes lie, as the (address, length) regions a transport moves.

ember's KV cache is one tensor of shape
``[num_blocks, num_layers, planes, block_size, num_kv_heads, head_dim]`` (planes: K and V, or
MLA's one latent vector): block-major, so block ``b`` (its KV for every layer) is the one
contiguous run of ``block_bytes`` bytes starting at ``base + b * block_bytes``, where
``block_bytes = num_layers * planes * block_size * num_kv_heads * head_dim * element_size``. A transfer of a block list is therefore a list of regions, one per run
of consecutive block ids: fewer, larger regions mean fewer requests on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def block_regions(
    base_addr: int, block_bytes: int, block_ids: Sequence[int]
) -> list[tuple[int, int]]:
    """(addr, nbytes) of the listed blocks, in order, with runs of consecutive ids merged."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
    regions: list[tuple[int, int]] = []
    prev = None
    for b in block_ids:
        if b < 0:
            raise ValueError(f"negative block id {b}")
        if prev is not None and b == prev + 1:
            addr, nbytes = regions[-1]
            regions[-1] = (addr, nbytes + block_bytes)
        else:
            regions.append((base_addr + b * block_bytes, block_bytes))
        prev = b
    return regions


def pair_regions(
    src_base: int,
    dst_base: int,
    block_bytes: int,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
) -> tuple[list[int], list[int], list[int]]:
    """(srcs, dsts, lens) copying block ``src_ids[i]`` to ``dst_ids[i]``, merged where both run on.

    The three lists are in the argument order of a batch transfer; a run is merged only while the
    source and the destination ids both advance by one, so every byte lands where its block goes.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    prev: tuple[int, int] | None = None
    for s, d in zip(src_ids, dst_ids, strict=True):
        if s < 0 or d < 0:
            raise ValueError(f"negative block id in pair ({s}, {d})")
        if prev is not None and s == prev[0] + 1 and d == prev[1] + 1:
            lens[-1] += block_bytes
        else:
            srcs.append(src_base + s * block_bytes)
            dsts.append(dst_base + d * block_bytes)
            lens.append(block_bytes)
        prev = (s, d)
    return srcs, dsts, lens


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """How one rank's KV cache maps onto a block of a prefill engine's rank: of every (layer,
    plane, slot) run of a block, `count` heads from `head_start` of the `full_heads` the remote
    rank holds land at `local_start` of the `local_heads` this rank holds.

    A prefill engine of one rank holds every KV head; a decode engine of tensor_parallel_size N
    reads, on each rank, only its heads of each block: per block, `runs` (layers x planes x
    block_size) regions of `count * head_bytes` bytes. Ranks of a tensor-parallel prefill engine
    each hold a share of the heads, so a rank may read its heads from several of them, one
    layout each (ember/engine/kv_connector.rank_layouts). A rank reading every head of a remote
    block into every head of its own (one rank from one, or MLA's one latent vector) reads whole
    blocks, merged where ids run on."""

    runs: int
    full_heads: int
    local_heads: int
    head_start: int
    head_bytes: int
    """Bytes of one head's vector of one token (head_dim x element size)."""
    count: int = -1
    """Heads copied; -1: `local_heads`."""
    local_start: int = 0

    @property
    def num_heads(self) -> int:
        return self.local_heads if self.count < 0 else self.count

    @property
    def remote_block_bytes(self) -> int:
        return self.runs * self.full_heads * self.head_bytes

    @property
    def local_block_bytes(self) -> int:
        return self.runs * self.local_heads * self.head_bytes

    @property
    def whole(self) -> bool:
        return self.num_heads == self.local_heads == self.full_heads

    def pairs(
        self,
        src_base: int,
        dst_base: int,
        src_ids: Sequence[int],
        dst_ids: Sequence[int],
    ) -> tuple[list[int], list[int], list[int]]:
        """(srcs, dsts, lens) copying this layout's heads of block ``src_ids[i]`` (a prefill
        engine rank's) into block ``dst_ids[i]`` (this rank's)."""
        if self.whole:
            return pair_regions(src_base, dst_base, self.local_block_bytes, src_ids, dst_ids)
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
        count = self.num_heads
        if self.head_start < 0 or self.head_start + count > self.full_heads:
            raise ValueError(
                f"heads {self.head_start}..{self.head_start + count} "
                f"outside the {self.full_heads} a block holds"
            )
        if self.local_start < 0 or self.local_start + count > self.local_heads:
            raise ValueError(
                f"heads {self.local_start}..{self.local_start + count} "
                f"outside the {self.local_heads} this rank holds"
            )
        src_run = self.full_heads * self.head_bytes
        dst_run = self.local_heads * self.head_bytes
        n = count * self.head_bytes
        src_off = self.head_start * self.head_bytes
        dst_off = self.local_start * self.head_bytes
        srcs: list[int] = []
        dsts: list[int] = []
        for s, d in zip(src_ids, dst_ids, strict=True):
            if s < 0 or d < 0:
                raise ValueError(f"negative block id in pair ({s}, {d})")
            src0 = src_base + s * self.remote_block_bytes + src_off
            dst0 = dst_base + d * self.local_block_bytes + dst_off
            srcs.extend(src0 + i * src_run for i in range(self.runs))
            dsts.extend(dst0 + i * dst_run for i in range(self.runs))
        return srcs, dsts, [n] * len(srcs)
