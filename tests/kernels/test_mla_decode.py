"""The Triton MLA decode kernel against mla_attention_ref (ember/attention/mla.py) on fresh random
latent caches: shuffled block tables, contexts short and long (empty splits), head counts that do
not fill a head block, one split and many; fp32 in the interpreter, bf16/fp16 on a GPU."""

from __future__ import annotations

import pytest
import torch

from ember.attention.metadata import AttentionMetadata
from ember.attention.mla import mla_attention_ref
from ember.kernels.mla_decode import mla_decode

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _case(seq_lens, heads, rank, rope, page, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in seq_lens]
    num_blocks = sum(pages) + 3
    cache = torch.randn(num_blocks, 1, page, 1, rank + rope, generator=g).to(device, dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(pages)
    tables, at = [], 0
    for n in pages:
        tables.append(order[at : at + n] + [0] * (width - n))
        at += n
    b = len(seq_lens)
    q_latent = torch.randn(b, heads, rank, generator=g).to(device, dtype)
    q_rope = torch.randn(b, heads, rope, generator=g).to(device, dtype)
    md = AttentionMetadata(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(b, dtype=torch.int64, device=device),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(b + 1)),
        seq_lens_cpu=list(seq_lens),
        num_decodes=b,
    )
    return q_latent, q_rope, cache, md


def _check(
    seq_lens, heads, rank, rope, page, dtype, device, seed, splits, tol, lens=torch.int32
) -> None:
    q_latent, q_rope, cache, md = _case(seq_lens, heads, rank, rope, page, dtype, device, seed)
    scale = (rank + rope) ** -0.5 * 1.3
    want = mla_attention_ref(q_latent.float(), q_rope.float(), cache.float(), md, scale)
    out = torch.full_like(q_latent, float("nan"))
    got = mla_decode(
        q_latent,
        q_rope,
        cache,
        md.seq_lens.to(lens),
        md.block_tables,
        scale,
        out=out,
        num_splits=splits,
        max_seq_len=md.max_seq_len,
    )
    assert got is out and torch.isfinite(out).all()
    err = (out.float() - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), err


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "seq_lens,splits",
    [([1, 37, 130], 4), ([70], 1), ([5, 300, 16], 3), ([200], None)],
    ids=["mixed-4-splits", "one-split", "empty-splits", "heuristic"],
)
@pytest.mark.parametrize(
    "heads,rank,rope,page",
    [(4, 32, 8, 4), (20, 64, 16, 16), (1, 16, 16, 8)],
    ids=["tiny", "heads-past-a-block", "one-head"],
)
def test_mla_decode_matches_the_reference(seed, seq_lens, splits, heads, rank, rope, page) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check(seq_lens, heads, rank, rope, page, torch.float32, device, seed, splits, 2e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_mla_decode_takes_int64_seq_lens(splits: int) -> None:
    """The decode graphs hold seq_lens as int64 (the eager path int32): the kernel casts them."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check([5, 300, 16], 20, 64, 16, 16, torch.float32, device, 2, splits, 2e-5, torch.int64)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq_lens", [[1, 700, 4000, 33], [8192]])
@pytest.mark.parametrize("lens", [torch.int32, torch.int64])
def test_mla_decode_kimi_shape_on_the_gpu(
    dtype: torch.dtype, seq_lens: list[int], lens: torch.dtype
) -> None:
    """Kimi K2's latent (512 + 64) with 64 heads a rank; seq_lens as either path holds them."""
    _check(seq_lens, 64, 512, 64, 16, dtype, "cuda", 3, None, 2e-2, lens)
