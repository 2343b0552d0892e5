"""Kernel-test fixtures: the Triton interpreter on CPU-only machines, and random paged batches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

# tests/conftest.py sets TRITON_INTERPRET on machines without a GPU, before triton is imported,
# and mends the interpreter for NumPy 2.4.
from ember.attention.metadata import AttentionMetadata


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(slots=True)
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor  # one layer's strided view [num_blocks, 2, block_size, Hkv, D]
    metadata: AttentionMetadata


def _make_paged_batch(
    shapes: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> PagedBatch:
    """A batch of (cached, new) token counts whose whole context is already in the cache.

    Blocks are a random permutation, so tables are not contiguous; the cache has two layers, so
    the view is strided across blocks; every slot no sequence owns is NaN, block 0 included (the
    block-table padding), so a kernel that reads past a context or a table poisons its output.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in shapes]
    num_blocks = sum(blocks_per_seq) + 3
    full = torch.full(
        (num_blocks, 2, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
    )
    cache = full[:, 1]
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, qs, query_start_loc, seq_lens, slots = [], [], [0], [], []
    for (cached, new), nb in zip(shapes, blocks_per_seq, strict=True):
        total = cached + new
        table = [free.pop() for _ in range(nb)]
        kv = torch.randn(2, total, num_kv_heads, head_dim, generator=g).to(dtype)
        pos = torch.arange(total)
        # Mixed advanced indices around a slice put the token dim first: [total, 2, Hkv, D].
        cache[torch.tensor(table)[pos // block_size], :, pos % block_size] = kv.transpose(0, 1)
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(cached, total)
        ]
        tables.append(table)
        qs.append(torch.randn(new, num_heads, head_dim, generator=g).to(dtype))
        query_start_loc.append(query_start_loc[-1] + new)
        seq_lens.append(total)
    # Wider than needed: the padding must never be read.
    width = max(blocks_per_seq) + 2
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(n for _, n in shapes),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return PagedBatch(torch.cat(qs).to(device), full.to(device)[:, 1], metadata)


@pytest.fixture
def make_paged_batch() -> Callable[..., PagedBatch]:
    """`make_paged_batch(shapes, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
    seed)` -> PagedBatch; shapes are (cached, new) token counts per sequence."""
    return _make_paged_batch


def reference(batch: PagedBatch, scale: float) -> torch.Tensor:
    """paged_attention_ref on fp32 CPU copies (it builds its causal mask on the CPU)."""
    from ember.attention.torch_backend import paged_attention_ref

    cpu_md = batch.metadata.to("cpu")
    return paged_attention_ref(batch.q.float().cpu(), batch.kv_cache.float().cpu(), cpu_md, scale)


@pytest.fixture
def attention_reference() -> Callable[[PagedBatch, float], torch.Tensor]:
    """`attention_reference(batch, scale)` -> fp32 CPU output of paged_attention_ref."""
    return reference


@pytest.fixture
def assert_rel_close() -> Callable[[torch.Tensor, torch.Tensor, float], None]:
    """`assert_rel_close(out, ref, tol)`: every element written and ||out - ref|| / ||ref|| < tol."""

    def check(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
        out = out.float().cpu()
        assert out.shape == ref.shape
        assert not out.isnan().any(), f"{int(out.isnan().sum())} elements unwritten or NaN"
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < tol, f"relative error {err:.3e} >= {tol:.0e}"

    return check
