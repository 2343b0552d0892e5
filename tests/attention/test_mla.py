"""MLA's two ways to attend (ember/attention/mla.py) agree with the latent-space reference on fresh
random latent caches: the expanded path (per-head K/V, torch's fused attention) for fresh prompts
and over cached prefixes, and the split of short runs into one decode query a row. On a GPU,
mla_attention's mixed batch (decode rows, a short extend, a long prefill) in bf16."""

from __future__ import annotations

import pytest
import torch

from ember.attention.metadata import AttentionMetadata
from ember.attention.mla import (
    CUDNN_MIN_TOKENS,
    EXPAND_CHUNK,
    EXPAND_MIN_QUERY,
    _latent_rows,
    cudnn_bucket,
    mla_attention,
    mla_attention_ref,
    mla_prefill_expanded,
    warm_cudnn_plans,
)

HEADS, RANK, ROPE, NOPE, V, PAGE = 4, 32, 8, 16, 12, 4


def _batch(
    shapes: list[tuple[int, int]],
    seed: int,
    device: str = "cpu",
    num_decodes: int = 0,
    dims: tuple[int, int, int, int, int] | None = None,
):
    """(cached, new) token counts a sequence, every token's latent already in a shuffled cache.
    `dims`: (heads, nope, rope, v, rank) other than the module's."""
    heads, nope, rope, v_dim, rank = dims or (HEADS, NOPE, ROPE, V, RANK)
    g = torch.Generator().manual_seed(seed)
    pages = [-(-(c + n) // PAGE) for c, n in shapes]
    num_blocks = sum(pages) + 2
    cache = torch.randn(num_blocks, 1, PAGE, 1, rank + rope, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, at, qsl, lens, slots = [], 0, [0], [], []
    for (cached, new), n in zip(shapes, pages, strict=True):
        table = order[at : at + n]
        at += n
        tables.append(table + [0] * (max(pages) - n))
        qsl.append(qsl[-1] + new)
        lens.append(cached + new)
        slots += [table[p // PAGE] * PAGE + p % PAGE for p in range(cached, cached + new)]
    t = qsl[-1]
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(n for _, n in shapes),
        max_seq_len=max(lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
        num_decodes=num_decodes,
    )
    q_nope = torch.randn(t, heads, nope, generator=g)
    q_rope = torch.randn(t, heads, rope, generator=g)
    w_uk = torch.randn(heads, nope, rank, generator=g) / rank**0.5
    w_uv = torch.randn(heads, v_dim, rank, generator=g) / rank**0.5
    return q_nope, q_rope, cache, md, w_uk, w_uv


def _reference(q_nope, q_rope, cache, md, w_uk, w_uv, scale):
    q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
    o = mla_attention_ref(q_latent, q_rope, cache, md, scale)
    return torch.einsum("thl,hvl->thv", o, w_uv)


@pytest.mark.parametrize(
    "shapes",
    [[(0, 40)], [(0, 9), (0, 23)], [(17, 6)], [(30, 1), (0, 12), (5, 30)]],
    ids=["fresh", "two-fresh", "over-a-prefix", "mixed"],
)
def test_expanded_prefill_matches_latent_attention(shapes: list[tuple[int, int]]) -> None:
    q_nope, q_rope, cache, md, w_uk, w_uv = _batch(shapes, seed=len(shapes))
    scale = (NOPE + ROPE) ** -0.5
    want = _reference(q_nope, q_rope, cache, md, w_uk, w_uv, scale)
    got = torch.full_like(want, float("nan"))
    mla_prefill_expanded(
        q_nope, q_rope, cache, md, list(range(len(shapes))), w_uk, w_uv, scale, got
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 8, 29, 64])
def test_chunked_expansion_equals_unchunked(chunk: int) -> None:
    """The cached prefix in chunks of `chunk` tokens and the new tokens as one causal block,
    merged by their log-sum-exp: the same output as attending at once (float32, 1e-4), for
    fresh prompts longer than a chunk, short and long prefixes, and a prefix a chunk divides."""
    shapes = [(0, 40), (17, 6), (64, 3), (5, 30), (40, 24)]
    q_nope, q_rope, cache, md, w_uk, w_uv = _batch(shapes, seed=chunk)
    scale = (NOPE + ROPE) ** -0.5
    want = _reference(q_nope, q_rope, cache, md, w_uk, w_uv, scale)
    seqs = list(range(len(shapes)))
    got = torch.full_like(want, float("nan"))
    mla_prefill_expanded(q_nope, q_rope, cache, md, seqs, w_uk, w_uv, scale, got, chunk=chunk)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    whole = torch.full_like(want, float("nan"))
    mla_prefill_expanded(q_nope, q_rope, cache, md, seqs, w_uk, w_uv, scale, whole, chunk=1 << 20)
    torch.testing.assert_close(got, whole, atol=1e-4, rtol=1e-4)


def test_log_sum_exp_merge_of_two_halves_is_the_whole() -> None:
    from ember.attention.mla import attention_lse, merge_lse

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(3, n, d, generator=g) for n, d in ((5, 8), (12, 8), (12, 6)))
    whole, lse = attention_lse(q, k, v, False, 0.3)
    got = merge_lse([attention_lse(q, k[:, :7], v[:, :7], False, 0.3),
                     attention_lse(q, k[:, 7:], v[:, 7:], False, 0.3)])  # fmt: skip
    torch.testing.assert_close(got, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(torch.einsum("htd,hsd->hts", q, k) * 0.3, -1))


def test_short_runs_split_into_one_causal_query_a_row() -> None:
    """Two decode rows, a 3-token extend over 10 cached tokens, a long run left out (expanded):
    each remaining row becomes a one-query sequence over its causal prefix, and attending that
    way equals attending the runs whole."""
    shapes = [(8, 1), (20, 1), (10, 3), (0, 6)]
    q_nope, q_rope, cache, md, w_uk, w_uv = _batch(shapes, seed=5, num_decodes=2)
    rows, lens, tables = _latent_rows(md, 2, expanded={3})
    assert rows.tolist() == [0, 1, 2, 3, 4]
    assert lens.tolist() == [9, 21, 11, 12, 13]
    assert torch.equal(tables, md.block_tables[[0, 1, 2, 2, 2]])
    per_row = AttentionMetadata(
        query_start_loc=torch.arange(6, dtype=torch.int32),
        seq_lens=lens,
        block_tables=tables,
        slot_mapping=md.slot_mapping[rows],
        max_query_len=1,
        max_seq_len=md.max_seq_len,
        query_start_loc_cpu=list(range(6)),
        seq_lens_cpu=lens.tolist(),
        num_decodes=5,
    )
    scale = 0.3
    want = _reference(q_nope, q_rope, cache, md, w_uk, w_uv, scale)[rows]
    got = _reference(q_nope[rows], q_rope[rows], cache, per_row, w_uk, w_uv, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert _latent_rows(md, 2, expanded={2, 3}) is None  # only the decode rows remain


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_attention_mixed_batch_on_the_gpu(dtype: torch.dtype) -> None:
    """Decode rows, a short extend over a prefix, a long fresh prefill and a long prefill over a
    prefix in one step, through the kernel and the expanded path, against the CPU reference."""
    n = EXPAND_MIN_QUERY
    shapes = [(50, 1), (3, 1), (40, 5), (0, n + 7), (33, n)]
    q_nope, q_rope, cache, md, w_uk, w_uv = _batch(shapes, seed=7, num_decodes=2)
    scale = (NOPE + ROPE) ** -0.5
    # The step's own latents are written by mla_attention: take them out of the cache first.
    block, off = md.slot_mapping // PAGE, md.slot_mapping % PAGE
    latent = cache[block, 0, off, 0].clone()
    want = _reference(q_nope, q_rope, cache, md, w_uk, w_uv, scale)
    cache[block, 0, off, 0] = float("nan")
    cuda_md = md.to("cuda")

    def dev(x: torch.Tensor) -> torch.Tensor:
        return x.to("cuda", dtype)

    got = mla_attention(
        dev(q_nope),
        dev(q_rope),
        dev(latent),
        dev(w_uk),
        dev(w_uv),
        dev(cache),
        cuda_md,
        scale,
    )
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = (got.float().cpu() - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_expansion_on_the_gpu(dtype: torch.dtype) -> None:
    """Contexts past the chunk on a GPU, at head dims cuDNN takes (q/k 64 + 64, v 64): in bf16
    the parts' log-sum-exp from cuDNN's attention, in float32 from the math; against the CPU
    reference."""
    shapes = [(0, 40), (100, 6), (64, 30), (37, 129)]
    q_nope, q_rope, cache, md, w_uk, w_uv = _batch(shapes, seed=21, dims=(4, 64, 64, 64, 64))
    scale = 128**-0.5
    want = _reference(q_nope, q_rope, cache, md, w_uk, w_uv, scale)

    def dev(x: torch.Tensor) -> torch.Tensor:
        return x.to("cuda", dtype)

    got = torch.full_like(dev(want), float("nan"))
    seqs = list(range(len(shapes)))
    args = (dev(q_nope), dev(q_rope), dev(cache), md.to("cuda"), seqs, dev(w_uk), dev(w_uv))
    mla_prefill_expanded(*args, scale, got, chunk=16)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = (got.float().cpu() - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), err


def test_cudnn_buckets_are_few_and_waste_a_quarter_at_most() -> None:
    """A fresh prompt's padded length: at least its own, at most a quarter more (and at least
    256 a step), the same for every length of a bucket, 13 buckets from 1,024 to 8,192 tokens."""
    lengths = range(CUDNN_MIN_TOKENS, EXPAND_CHUNK + 1)
    buckets = [cudnn_bucket(n) for n in lengths]
    assert all(n <= b <= max(n * 1.25, n + 255) for n, b in zip(lengths, buckets, strict=True))
    assert buckets == sorted(buckets)
    assert len(set(buckets)) == 13 and max(buckets) == EXPAND_CHUNK
    assert cudnn_bucket(3000) == 3072 and cudnn_bucket(8000) == 8192 and cudnn_bucket(1025) == 1280


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fresh_prompts_at_bucketed_lengths_on_the_gpu() -> None:
    """Fresh prompts long enough for cuDNN's kernel, padded to their bucket (1,500 -> 1,536; one
    exactly a bucket), beside a prompt over a cached prefix (the memory-efficient kernel), at
    MLA's head dims (q/k 128 + 64, v 128), bf16, against the CPU reference."""
    shapes = [(0, 1500), (0, 1024), (20, 1100)]
    q_nope, q_rope, cache, md, w_uk, w_uv = _batch(shapes, seed=5, dims=(2, 128, 64, 128, 64))
    scale = 192**-0.5
    want = _reference(q_nope, q_rope, cache, md, w_uk, w_uv, scale)

    def dev(x: torch.Tensor) -> torch.Tensor:
        return x.to("cuda", torch.bfloat16)

    got = torch.full_like(dev(want), float("nan"))
    args = (dev(q_nope), dev(q_rope), dev(cache), md.to("cuda"), [0, 1, 2], dev(w_uk), dev(w_uv))
    mla_prefill_expanded(*args, scale, got)
    err = (got.float().cpu() - want).abs().max().item()
    assert err <= 3e-2 * want.abs().max().item(), err
    assert warm_cudnn_plans(2, 192, 128, torch.bfloat16, torch.device("cuda"), 3000) == 7
