"""Attention over an FP8 KV cache (`kv_cache_dtype="fp8"`): the Triton decode, prefill and MLA
decode kernels read FP8 K, V and latents back to the queries' dtype and equal the plain-PyTorch
references run on the same FP8 cache (fresh random inputs; float32 queries in the interpreter,
bfloat16 on a GPU). And the cache is what makes the difference from an unquantized one: FP8
E4M3's rounding, a few percent."""

from __future__ import annotations

import pytest
import torch

from ember.attention.mla import mla_attention_ref
from ember.kernels.decode_attention import decode_attention
from ember.kernels.kv_dtype import to_cache
from ember.kernels.mla_decode import mla_decode
from ember.kernels.prefill_attention import prefill_attention
from tests.kernels.test_mla_decode import _case

FP8 = torch.float8_e4m3fn
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _fp8(batch):  # type: ignore[no-untyped-def]
    """The batch's cache as an FP8 cache holds it (NaN where no sequence wrote: still NaN)."""
    batch.kv_cache = to_cache(batch.kv_cache, FP8)
    return batch


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_reads_an_fp8_cache(
    make_paged_batch, attention_reference, assert_rel_close, seed, device
) -> None:
    batch = make_paged_batch([(40, 1), (300, 1), (0, 1)], 4, 2, 32, 16, torch.float32, device, seed)
    exact = attention_reference(batch, 32**-0.5)
    batch = _fp8(batch)
    md = batch.metadata
    out = decode_attention(
        batch.q, batch.kv_cache, md.seq_lens, md.block_tables, 32**-0.5, max_seq_len=md.max_seq_len
    )
    want = attention_reference(batch, 32**-0.5)  # (the reference reads the FP8 cache as floats)
    assert_rel_close(out, want, 1e-5)
    err = ((out.float().cpu() - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 0.06, err  # FP8's rounding of K and V shows, and no more than that


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_reads_an_fp8_cache(
    make_paged_batch, attention_reference, assert_rel_close, seed, device
) -> None:
    shapes = [(37, 20), (0, 9), (70, 33)]
    batch = _fp8(make_paged_batch(shapes, 4, 1, 64, 16, torch.float32, device, seed))
    md = batch.metadata
    out = prefill_attention(
        batch.q,
        batch.kv_cache,
        md.query_start_loc,
        md.seq_lens,
        md.block_tables,
        64**-0.5,
        max(n for _, n in shapes),
    )
    assert_rel_close(out, attention_reference(batch, 64**-0.5), 1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_mla_decode_reads_an_fp8_cache(seed: int, device: str) -> None:
    q_latent, q_rope, cache, md = _case([1, 37, 130], 4, 32, 8, 16, torch.float32, device, seed)
    cache = to_cache(cache, FP8)
    scale = 40**-0.5
    want = mla_attention_ref(q_latent.float(), q_rope.float(), cache.float(), md, scale)
    out = mla_decode(q_latent, q_rope, cache, md.seq_lens, md.block_tables, scale, num_splits=3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_cache_bf16_queries_gpu(make_paged_batch, attention_reference, seed) -> None:
    """On the GPU, bf16 queries over an FP8 cache: decode, prefill through the cache and MLA
    decode, each against its reference on the same cache (bf16's own error)."""
    batch = _fp8(
        make_paged_batch(
            [(500, 1), (2000, 1), (63, 1)], 32, 8, 128, 64, torch.bfloat16, "cuda", seed
        )
    )
    md = batch.metadata
    out = decode_attention(
        batch.q, batch.kv_cache, md.seq_lens, md.block_tables, 128**-0.5, max_seq_len=md.max_seq_len
    )
    want = attention_reference(batch, 128**-0.5)
    assert ((out.float().cpu() - want).norm() / want.norm()).item() < 2e-2
    shapes = [(300, 200), (0, 129), (64, 64)]
    batch = _fp8(make_paged_batch(shapes, 32, 8, 128, 64, torch.bfloat16, "cuda", seed))
    md = batch.metadata
    out = prefill_attention(
        batch.q, batch.kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, 128**-0.5, 200
    )
    want = attention_reference(batch, 128**-0.5)
    assert ((out.float().cpu() - want).norm() / want.norm()).item() < 2e-2
    q_latent, q_rope, cache, md = _case(
        [1, 700, 4000], 16, 512, 64, 64, torch.bfloat16, "cuda", seed
    )
    cache = to_cache(cache, FP8)
    want = mla_attention_ref(q_latent.float(), q_rope.float(), cache.float(), md, 576**-0.5)
    out = mla_decode(q_latent, q_rope, cache, md.seq_lens, md.block_tables, 576**-0.5)
    assert ((out.float() - want).norm() / want.norm()).item() < 2e-2
