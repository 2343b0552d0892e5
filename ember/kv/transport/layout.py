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
