"""Varlen paged prefill attention against paged_attention_ref, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.prefill_attention import prefill_attention
from tests.outside_interpreter import run_script

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _tma_runs() -> bool:
    return torch.cuda.get_device_capability()[0] >= 9


def _check(
    make_paged_batch,
    attention_reference,
    assert_rel_close,
    shapes: list[tuple[int, int]],
    heads: tuple[int, int, int],
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    tol: float,
    tma: bool | None = None,
    front: int = 0,
) -> None:
    """prefill_attention against the reference; `tma` as prefill_attention takes it (True: the
    paged TMA kernel, on a CPU in Triton's interpreter); the first `front` sequences are decode
    rows with their own output, left alone."""
    batch = make_paged_batch(shapes, *heads, block_size, dtype, device, seed)
    md = batch.metadata
    scale = heads[2] ** -0.5
    out = torch.full_like(batch.q, float("nan"))
    out[:front] = 7.0
    got = prefill_attention(
        batch.q,
        batch.kv_cache,
        md.query_start_loc[front:],
        md.seq_lens[front:],
        md.block_tables[front:],
        scale,
        max(n for _, n in shapes[front:]),
        out=out,
        tma=tma,
    )
    assert got is out and bool((out[:front] == 7).all())
    assert_rel_close(out[front:], attention_reference(batch, scale)[front:], tol)


def _random_shapes(n: int, max_cached: int, max_new: int, seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    cached = torch.randint(0, max_cached + 1, (n,), generator=g).tolist()
    new = torch.randint(1, max_new + 1, (n,), generator=g).tolist()
    return list(zip(cached, new, strict=True))


# (cached prefix, new tokens) per sequence.
SHAPES = {
    # No prefix, a partial block, exactly one block, several blocks; q_len-1 rows mixed in.
    # 62 cached puts the first query one key short of a full 64-key tile: the edge of the run
    # of keys that every row of the tile sees.
    "mixed": [(0, 37), (5, 1), (16, 20), (62, 9), (3, 1)],
    # Two query tiles, each with a run of keys that needs no causal mask.
    "one-long": [(63, 150)],
    "decode-rows": [(33, 1), (0, 1), (70, 1)],
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "heads,block_size",
    # Few heads: the interpreter pays per program, and the kernel is the same for any count.
    [((2, 2, 16), 16), ((4, 1, 64), 16), ((8, 1, 32), 8), ((1, 1, 128), 32)],
    ids=["gqa1-d16", "gqa4-d64", "gqa8-d32-bs8", "gqa1-d128-bs32"],
)
@pytest.mark.parametrize("case", list(SHAPES))
def test_prefill_matches_reference(
    make_paged_batch, attention_reference, assert_rel_close, seed, heads, block_size, case, device
) -> None:
    _check(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        SHAPES[case],
        heads,
        block_size,
        torch.float32,
        device,
        seed,
        1e-5,
    )


@pytest.mark.parametrize("seed", [3, 4])
def test_prefill_many_sequences(
    make_paged_batch, attention_reference, assert_rel_close, seed, device
) -> None:
    shapes = _random_shapes(12, 80, 20, seed)
    _check(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        shapes,
        (2, 1, 16),
        16,
        torch.float32,
        device,
        seed,
        1e-5,
    )


@pytest.mark.parametrize("seed", [5, 6])
def test_prefill_after_decode_rows(
    make_paged_batch, attention_reference, assert_rel_close, seed, device
) -> None:
    # A mixed batch with its decode rows first: the prefill kernel gets the tail of the metadata,
    # whose query offsets start above 0, and must leave the decode rows' output alone. More
    # decode rows than a 16-row tile, so whole tiles of the grid fall before the first sequence.
    nd = 20
    shapes = [(3 * i, 1) for i in range(nd)] + [(0, 13), (62, 9)]
    batch = make_paged_batch(shapes, 4, 2, 16, 16, torch.float32, device, seed)
    md, scale = batch.metadata, 0.25
    out = torch.full_like(batch.q, float("nan"))
    # Not NaN, which a stray write of 0/0 would leave looking untouched.
    out[:nd] = decode_out = torch.randn(out[:nd].shape, device=device)
    prefill_attention(
        batch.q,
        batch.kv_cache,
        md.query_start_loc[nd:],
        md.seq_lens[nd:],
        md.block_tables[nd:],
        scale,
        max_query_len=13,
        out=out,
    )
    assert torch.equal(out[:nd], decode_out)
    assert_rel_close(out[nd:], attention_reference(batch, scale)[nd:], 1e-5)


@pytest.mark.parametrize("seed", [7, 8])
def test_prefill_fp16(
    make_paged_batch, attention_reference, assert_rel_close, seed, device
) -> None:
    # fp16 runs in the interpreter too (its bf16 tl.dot is wrong in triton 3.6: GPU tests only).
    _check(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        SHAPES["mixed"],
        (4, 2, 64),
        16,
        torch.float16,
        device,
        seed,
        1e-2,
    )


def test_prefill_rejects_bad_metadata(device: str) -> None:
    cache = torch.zeros(4, 2, 16, 1, 16, device=device)
    q = torch.zeros(3, 2, 16, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill_attention(q, cache, qsl[:1], lens, lens[:, None], 1.0, 3)
    with pytest.raises(ValueError, match="int32 or int64"):
        prefill_attention(q, cache, qsl.float(), lens, lens[:, None], 1.0, 3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads", [(8, 8, 64), (32, 8, 128), (32, 4, 128)], ids=["gqa1", "gqa4", "gqa8"]
)
@pytest.mark.parametrize("case", list(SHAPES))
def test_prefill_half_precision(
    make_paged_batch, attention_reference, assert_rel_close, seed, dtype, heads, case
) -> None:
    _check(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        SHAPES[case],
        heads,
        16,
        dtype,
        "cuda",
        seed,
        1e-2,
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_llama3_8b(make_paged_batch, attention_reference, assert_rel_close, seed) -> None:
    # Chunked prefill next to decode rows: prefixes up to 3k, chunks up to 1k, q_len-1 rows.
    shapes = _random_shapes(6, 3072, 1024, seed) + [(4000, 1), (0, 1), (17, 1)]
    _check(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        shapes,
        (32, 8, 128),
        16,
        torch.bfloat16,
        "cuda",
        seed,
        1e-2,
    )


# -- fresh prefills: keys from this step's K and V rows, not the cache --------------------------


def _fresh_check(
    make_paged_batch,
    attention_reference,
    assert_rel_close,
    shapes,
    heads,
    dtype,
    device,
    seed,
    tol,
    front: int = 0,
    tma: bool = False,
) -> None:
    """Every sequence after the first `front` (decode rows, given their own output) is fresh;
    k and v are strided views of one fused [T, Hq + 2 Hkv, D] projection, as in the engine, and
    the cache is poisoned with NaN once they are built: the fresh variant must not read it.
    `tma`: through the TMA kernel (on a CPU, in Triton's interpreter) rather than the pointer one."""
    batch = make_paged_batch(shapes, *heads, 16, dtype, device, seed)
    md, (hq, hkv, d) = batch.metadata, heads
    scale = d**-0.5
    ref = attention_reference(batch, scale)
    qkv = torch.empty(batch.q.shape[0], hq + 2 * hkv, d, dtype=dtype, device=device)
    qkv[:, :hq] = batch.q
    qsl, lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
    for i in range(front, len(shapes)):
        for pos in range(lens[i]):
            block = int(md.block_tables[i, pos // 16])
            qkv[qsl[i] + pos, hq : hq + hkv] = batch.kv_cache[block, 0, pos % 16]
            qkv[qsl[i] + pos, hq + hkv :] = batch.kv_cache[block, 1, pos % 16]
    batch.kv_cache.fill_(float("nan"))
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    out = torch.full_like(batch.q, float("nan"))
    out[:front] = 0.0
    got = prefill_attention(
        q,
        batch.kv_cache,
        md.query_start_loc[front:],
        md.seq_lens[front:],
        md.block_tables[front:],
        scale,
        md.max_query_len,
        out=out,
        k=k,
        v=v,
        tma=tma,
    )
    assert got is out and torch.equal(out[:front].float().cpu(), torch.zeros_like(ref[:front]))
    assert_rel_close(out[front:], ref[front:], tol)


FRESH = {
    # A partial tile, one row, a whole 64-key run then a diagonal, two query tiles.
    "short": [(0, 37), (0, 1), (0, 64), (0, 9)],
    "long": [(0, 150), (0, 3)],
}


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("heads", [(2, 2, 16), (4, 1, 64)], ids=["gqa1-d16", "gqa4-d64"])
@pytest.mark.parametrize("case", list(FRESH))
def test_fresh_prefill_reads_this_steps_rows(
    make_paged_batch, attention_reference, assert_rel_close, seed, heads, case, device, tma
) -> None:
    if tma and device == "cuda" and not _tma_runs():
        pytest.skip("TMA needs a Hopper GPU")
    _fresh_check(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        FRESH[case],
        heads,
        torch.float32,
        device,
        seed,
        1e-5,
        tma=tma,
    )


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_fresh_prefill_after_decode_rows(
    make_paged_batch, attention_reference, assert_rel_close, device, tma
) -> None:
    if tma and device == "cuda" and not _tma_runs():
        pytest.skip("TMA needs a Hopper GPU")
    shapes = [(5, 1), (20, 1), (0, 30), (0, 17)]
    _fresh_check(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        shapes,
        (2, 1, 16),
        torch.float32,
        device,
        3,
        1e-5,
        front=2,
        tma=tma,
    )


def test_fresh_prefill_rejects_bad_k_v(device: str) -> None:
    cache = torch.zeros(4, 2, 16, 1, 16, device=device)
    q = torch.zeros(3, 2, 16, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    k = torch.zeros(3, 1, 16, device=device)
    with pytest.raises(ValueError, match="both k and v"):
        prefill_attention(q, cache, qsl, lens, lens[:, None], 1.0, 3, k=k)
    with pytest.raises(ValueError, match="must be"):
        prefill_attention(q, cache, qsl, lens, lens[:, None], 1.0, 3, k=k, v=k[:2])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fresh_prefill_llama3_8b(
    make_paged_batch, attention_reference, assert_rel_close, seed, dtype, tma
) -> None:
    if tma and not _tma_runs():
        pytest.skip("TMA needs a Hopper GPU")
    g = torch.Generator().manual_seed(seed)
    shapes = [(0, int(n)) for n in torch.randint(1, 1500, (6,), generator=g)] + [(0, 2048)]
    _fresh_check(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        shapes,
        (32, 8, 128),
        dtype,
        "cuda",
        seed,
        1e-2,
        tma=tma,
    )


@pytest.mark.gpu
@needs_cuda
def test_tma_kernel_leaves_rows_outside_the_sequences() -> None:
    """Decode rows before the fresh ones and spare rows after: the TMA kernel's per-sequence
    descriptors must neither read them into a sequence nor write them; odd lengths end tiles
    mid-way, so each sequence's last tile overhangs the next one's rows."""
    if not _tma_runs():
        pytest.skip("TMA needs a Hopper GPU")
    g = torch.Generator(device="cuda").manual_seed(5)
    lens, front, back = [1, 63, 65, 129, 300, 2], 3, 5
    starts = torch.tensor([0, *lens], device="cuda").cumsum(0) + front
    total = front + sum(lens) + back
    qkv = torch.randn(total, 48, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
    out = torch.full_like(q, 7.0)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cache = torch.zeros(1, 2, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros(len(lens), 1, dtype=torch.int32, device="cuda")
    prefill_attention(
        q, cache, starts.int(), lens_t, table, 128**-0.5, max(lens), out=out, k=k, v=v, tma=True
    )
    assert bool((out[:front] == 7).all()) and bool((out[total - back :] == 7).all())
    for a, n in zip(starts.tolist(), lens, strict=False):
        want = torch.nn.functional.scaled_dot_product_attention(
            *(x[a : a + n].transpose(0, 1).float() for x in (q, k, v)),
            is_causal=True,
            enable_gqa=True,
        ).transpose(0, 1)
        torch.testing.assert_close(out[a : a + n].float(), want, atol=2e-2, rtol=2e-2)


def test_tma_kernel_is_not_chosen_off_a_hopper_gpu() -> None:
    from ember.kernels.prefill_attention_tma import usable

    q = torch.zeros(4, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(4, 1, 128, dtype=torch.bfloat16)
    assert not usable(q, k, k, q)
    if torch.cuda.is_available() and _tma_runs():
        qc, kc = q.cuda(), k.cuda()
        assert usable(qc, kc, kc, torch.empty_like(qc))
        assert not usable(qc.float(), kc.float(), kc.float(), qc.float())  # 32-bit
        q96 = torch.zeros(4, 4, 96, dtype=torch.bfloat16, device="cuda")
        k96 = torch.zeros(4, 1, 96, dtype=torch.bfloat16, device="cuda")
        assert not usable(q96, k96, k96, q96)  # head dim
        wide = torch.zeros(4, 4 * 128 + 4, dtype=torch.bfloat16, device="cuda")
        odd = wide[:, 4:].view(4, 4, 128)  # rows start 8 bytes in: not TMA-aligned
        assert not usable(odd, kc, kc, torch.empty_like(qc))


# (cached prefix, new tokens) per sequence, over pages of 64 or 128 tokens: prefixes ending
# mid-page and on a page's edge, a diagonal tile whose page runs past the context (the rest of
# the page is NaN), a run of unmasked tiles before two query tiles, one-row sequences.
PAGED = {
    "mixed": [(0, 37), (5, 1), (64, 20), (62, 9), (130, 70)],
    "long-prefix": [(300, 10), (191, 1)],
    "two-query-tiles": [(63, 150)],
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("heads", [(2, 2, 16), (4, 1, 64)], ids=["gqa1-d16", "gqa4-d64"])
@pytest.mark.parametrize("case", list(PAGED))
def test_paged_tma_kernel_matches_reference(
    make_paged_batch, attention_reference, assert_rel_close, seed, block_size, heads, case, device
) -> None:
    if device == "cuda" and not _tma_runs():
        pytest.skip("TMA needs a Hopper GPU")
    _check(
        make_paged_batch, attention_reference, assert_rel_close, PAGED[case], heads, block_size,
        torch.float32, device, seed, 1e-5, tma=True,
    )  # fmt: skip


def test_paged_tma_kernel_after_decode_rows(
    make_paged_batch, attention_reference, assert_rel_close, device
) -> None:
    if device == "cuda" and not _tma_runs():
        pytest.skip("TMA needs a Hopper GPU")
    shapes = [(40, 1), (100, 1), (0, 30), (70, 17)]
    _check(
        make_paged_batch, attention_reference, assert_rel_close, shapes, (2, 1, 16), 64,
        torch.float32, device, 3, 1e-5, tma=True, front=2,
    )  # fmt: skip


def test_paged_tma_kernel_takes_int64_metadata(
    make_paged_batch, attention_reference, assert_rel_close, device
) -> None:
    if device == "cuda" and not _tma_runs():
        pytest.skip("TMA needs a Hopper GPU")
    batch = make_paged_batch([(70, 17), (0, 30)], 2, 1, 16, 64, torch.float32, device, 4)
    md = batch.metadata
    out = prefill_attention(
        batch.q, batch.kv_cache, md.query_start_loc.long(), md.seq_lens.long(),
        md.block_tables.long(), 0.25, md.max_query_len, tma=True,
    )  # fmt: skip
    assert_rel_close(out, attention_reference(batch, 0.25), 1e-5)


def test_paged_tma_kernel_needs_whole_tiles_a_page(device: str) -> None:
    cache = torch.zeros(4, 2, 16, 1, 16, device=device)
    q = torch.zeros(3, 2, 16, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple of 64 tokens"):
        prefill_attention(q, cache, qsl, lens, lens[:, None] * 0, 1.0, 3, tma=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_tma_kernel_llama3_8b(
    make_paged_batch, attention_reference, assert_rel_close, seed, dtype
) -> None:
    """The 8B shape over pages of 64: chunks continuing long prompts, each cached prefix and
    chunk random, chosen by default (no `tma` argument) on a Hopper GPU."""
    if not _tma_runs():
        pytest.skip("TMA needs a Hopper GPU")
    g = torch.Generator().manual_seed(seed)
    cached = torch.randint(0, 3000, (5,), generator=g).tolist()
    new = torch.randint(1, 700, (5,), generator=g).tolist()
    batch = make_paged_batch(
        [*zip(cached, new, strict=True), (4096, 512)], 32, 8, 128, 64, dtype, "cuda", seed
    )
    md, scale = batch.metadata, 128**-0.5
    from ember.kernels.prefill_attention_tma import paged_usable

    assert paged_usable(batch.q, batch.kv_cache, batch.q)
    out = prefill_attention(
        batch.q, batch.kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, scale,
        md.max_query_len,
    )  # fmt: skip
    assert_rel_close(out, attention_reference(batch, scale), 1e-2)


def test_paged_tma_kernel_is_chosen_for_whole_tile_pages_on_hopper() -> None:
    from ember.kernels.prefill_attention_tma import paged_usable

    q = torch.zeros(4, 4, 128, dtype=torch.bfloat16)
    cache = torch.zeros(3, 2, 2, 64, 1, 128, dtype=torch.bfloat16)[:, 1]  # block-major, strided
    assert not paged_usable(q, cache, q)  # no GPU
    if torch.cuda.is_available() and _tma_runs():
        qc, cc = q.cuda(), cache.cuda()
        assert paged_usable(qc, cc, torch.empty_like(qc))
        assert not paged_usable(qc, cc[:, :, :16].contiguous(), qc)  # pages of 16
        assert not paged_usable(qc, cc.half(), qc)  # the cache in another type
        assert not paged_usable(qc, cc.transpose(1, 2), qc)  # planes not page-major


_SM90_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from ember.kernels.prefill_attention_tma import _fresh_tma_kernel as fn
done = {}
for offsets in ("*i32", "*i64"):
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
           "query_start_loc_ptr": offsets, "qk_scale": "fp32", "num_seqs": "i32",
           "stride_qt": "i32", "stride_kt": "i32", "stride_vt": "i32", "stride_ot": "i32"}
    consts = {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_M": 128,
              "BLOCK_N": 64, "DOT_PRECISION": "tf32"}
    sig.update({k: "constexpr" for k in consts})
    constants = {(list(sig).index(k),): v for k, v in consts.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    c = triton.compile(ASTSource(fn, sig, constants, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 2})
    done[offsets] = c.asm["ptx"].count("cp.async.bulk.tensor")
print(json.dumps(done))
"""


_SM90_PAGED = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from ember.kernels.prefill_attention_tma import _paged_tma_kernel as fn
done = {}
for ints in ("*i32", "*i64"):
    sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "out_ptr": "*bf16", "query_start_loc_ptr": ints,
           "seq_lens_ptr": ints, "block_tables_ptr": ints, "qk_scale": "fp32", "num_seqs": "i32",
           "num_blocks": "i32", "stride_qt": "i32", "stride_ot": "i32", "stride_bt": "i32",
           "stride_cache_block": "i32"}
    consts = {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "PAGE_SIZE": 64,
              "BLOCK_M": 128, "BLOCK_N": 64, "DOT_PRECISION": "tf32"}
    sig.update({k: "constexpr" for k in consts})
    constants = {(list(sig).index(k),): v for k, v in consts.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    c = triton.compile(ASTSource(fn, sig, constants, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 2})
    ptx = c.asm["ptx"]
    done[ints] = {"tma": ptx.count("cp.async.bulk.tensor"),
                  "wgmma": ptx.count("wgmma.mma_async")}
print(json.dumps(done))
"""


def test_paged_tma_kernel_compiles_for_hopper(tmp_path) -> None:
    """Compiled for sm_90 outside the interpreter, with the metadata (offsets, lengths, block
    tables) as int32 or int64, which prefill_attention both takes: K and V tiles through the TMA
    engine and the matmuls on wgmma."""
    got = run_script(_SM90_PAGED, tmp_path)
    for ints in ("*i32", "*i64"):
        assert got[ints]["tma"] > 0 and got[ints]["wgmma"] > 0, got


def test_tma_kernel_compiles_for_hopper_with_either_offset_type(tmp_path) -> None:
    """query_start_loc may be int32 or int64 (prefill_attention takes both); a TMA descriptor's
    shape is 32-bit. Compiled for sm_90 with Triton's own ptxas (no GPU), outside the
    interpreter; the PTX must use the TMA engine."""
    tma_ops = run_script(_SM90_COMPILE, tmp_path)
    assert tma_ops["*i32"] > 0 and tma_ops["*i64"] > 0
