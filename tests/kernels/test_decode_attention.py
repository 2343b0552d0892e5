"""Split-K paged decode attention against paged_attention_ref, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

import ember.kernels.decode_attention as da
from ember.kernels.decode_attention import choose_num_splits, decode_attention

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _check(
    make_paged_batch,
    attention_reference,
    assert_rel_close,
    seq_lens: list[int],
    heads: tuple[int, int, int],
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    num_splits: int | None,
    tol: float,
) -> None:
    num_heads, num_kv_heads, head_dim = heads
    batch = make_paged_batch(
        [(n - 1, 1) for n in seq_lens], *heads, block_size, dtype, device, seed
    )
    md = batch.metadata
    scale = head_dim**-0.5
    out = torch.full_like(batch.q, float("nan"))
    got = decode_attention(
        batch.q,
        batch.kv_cache,
        md.seq_lens,
        md.block_tables,
        scale,
        out=out,
        num_splits=num_splits,
        max_seq_len=md.max_seq_len,
    )
    assert got is out
    assert_rel_close(out, attention_reference(batch, scale), tol)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "heads,block_size",
    # Few heads: the interpreter pays per program, and the kernel is the same for any count.
    [((2, 2, 16), 16), ((4, 1, 64), 16), ((8, 1, 32), 8), ((1, 1, 128), 32)],
    ids=["gqa1-d16", "gqa4-d64", "gqa8-d32-bs8", "gqa1-d128-bs32"],
)
@pytest.mark.parametrize(
    "seq_lens,num_splits",
    [
        # Many sequences, short and long: the short ones leave most of their splits empty.
        ([1, 40, 300, 651], 4),
        ([1000], None),  # one sequence, splits from the heuristic
        ([5, 130, 77], 1),  # one split: stage 1 writes the output directly
    ],
    ids=["many-split4", "one-auto", "few-split1"],
)
def test_decode_matches_reference(
    make_paged_batch,
    attention_reference,
    assert_rel_close,
    seed,
    heads,
    block_size,
    seq_lens,
    num_splits,
    device,
) -> None:
    _check(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        seq_lens,
        heads,
        block_size,
        torch.float32,
        device,
        seed,
        num_splits,
        1e-5,
    )


@pytest.mark.parametrize("seed", [3, 4])
def test_decode_more_splits_than_tiles(
    make_paged_batch, attention_reference, assert_rel_close, seed, device
) -> None:
    # 8 splits over at most 3 tiles of keys: most splits of every sequence are empty.
    _check(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        [2, 65, 190],
        (4, 2, 16),
        16,
        torch.float32,
        device,
        seed,
        8,
        1e-5,
    )


@pytest.mark.parametrize("seed", [5, 6])
def test_decode_fp16(make_paged_batch, attention_reference, assert_rel_close, seed, device) -> None:
    # fp16 runs in the interpreter too (its bf16 tl.dot is wrong in triton 3.6: GPU tests only).
    _check(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        [3, 300],
        (4, 2, 64),
        16,
        torch.float16,
        device,
        seed,
        3,
        1e-2,
    )


@pytest.mark.parametrize(
    "setting",
    [
        {"head_major": False, "num_stages": 2},
        {"block_n": 32, "num_warps": 8, "num_stages": 3},
        {"block_n": 128, "head_major": True},
    ],
    ids=["row-order", "n32-w8-s3", "n128-head-major"],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_launch_settings_match_reference(
    make_paged_batch,
    attention_reference,
    assert_rel_close,
    setting,
    num_splits,
    device,
    monkeypatch,
) -> None:
    # Every tile, pipeline and grid order the sweep (benchmarks/probes/decode_attention_sweep.py) may
    # set computes the same attention: tiles that span pages, either grid order.
    for key, value in setting.items():
        monkeypatch.setattr(da, key.upper(), value)
    heads = (8, 2, 16)
    batch = make_paged_batch(
        [(n - 1, 1) for n in (1, 70, 300)], *heads, 16, torch.float32, device, 7
    )
    md = batch.metadata
    scale = 16**-0.5
    out = decode_attention(
        batch.q,
        batch.kv_cache,
        md.seq_lens,
        md.block_tables,
        scale,
        num_splits=num_splits,
        max_seq_len=md.max_seq_len,
    )
    assert_rel_close(out, attention_reference(batch, scale), 1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_int64_seq_lens_match_reference(
    make_paged_batch, attention_reference, assert_rel_close, num_splits, device
) -> None:
    # The decode graphs hold seq_lens as int64, the eager path as int32: the kernel casts them.
    heads = (8, 2, 16)
    batch = make_paged_batch(
        [(n - 1, 1) for n in (1, 70, 300)], *heads, 16, torch.float32, device, 8
    )
    md = batch.metadata
    out = decode_attention(
        batch.q,
        batch.kv_cache,
        md.seq_lens.to(torch.int64),
        md.block_tables,
        16**-0.5,
        num_splits=num_splits,
        max_seq_len=md.max_seq_len,
    )
    assert_rel_close(out, attention_reference(batch, 16**-0.5), 1e-5)


def test_decode_head_major_falls_back_past_the_grid_limit(
    make_paged_batch, attention_reference, assert_rel_close, device, monkeypatch
) -> None:
    # More rows than a grid's second dimension holds: the launch puts rows first instead.
    kernel, grids = da._decode_split_kernel, []

    class Recording:  # the kernel, its launch grids recorded
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(da, "_decode_split_kernel", Recording())
    monkeypatch.setattr(da, "MAX_GRID_Y", 2)
    heads = (8, 2, 16)
    batch = make_paged_batch(
        [(n - 1, 1) for n in (1, 70, 300)], *heads, 16, torch.float32, device, 9
    )
    md = batch.metadata
    out = decode_attention(
        batch.q, batch.kv_cache, md.seq_lens, md.block_tables, 0.25, max_seq_len=md.max_seq_len
    )
    assert_rel_close(out, attention_reference(batch, 0.25), 1e-5)
    assert grids and all(g[0] == 3 for g in grids), grids  # rows first: 3 rows, not 2 KV heads


def test_decode_zero_length_row_gives_zeros(device: str) -> None:
    # A CUDA-graph padding row with seq_len 0 must not produce NaN.
    cache = torch.randn(4, 2, 16, 1, 16, device=device)
    q = torch.randn(2, 2, 16, device=device)
    seq_lens = torch.tensor([0, 3], dtype=torch.int32, device=device)
    tables = torch.tensor([[0], [2]], dtype=torch.int32, device=device)
    for splits in (1, 3):
        out = decode_attention(q, cache, seq_lens, tables, 0.25, num_splits=splits)
        assert torch.equal(out[0].cpu(), torch.zeros(2, 16))
        assert not out.isnan().any()


def test_choose_num_splits() -> None:
    # Small batch, long context: enough splits to give 132 SMs four programs each.
    assert choose_num_splits(2, 8, 32768) == 33
    # Capped by the context: no split shorter than 256 tokens.
    assert choose_num_splits(1, 8, 1000) == 4
    assert choose_num_splits(4, 8, 1) == 1
    # A batch that already fills the GPU gets one or two.
    assert choose_num_splits(64, 8, 4096) == 2
    assert choose_num_splits(128, 8, 4096) == 1
    assert choose_num_splits(1, 1, 10**6) == 64
    assert choose_num_splits(1, 8, 4096, num_sms=78) == 16
    with pytest.raises(ValueError):
        choose_num_splits(0, 8, 100)


def test_choose_num_splits_reads_the_module_default(monkeypatch) -> None:
    # profile_mixed.py --decode-splits-per-sm sets the module's PROGRAMS_PER_SM for an engine.
    monkeypatch.setattr(da, "PROGRAMS_PER_SM", 8)
    choose_num_splits.cache_clear()
    try:
        assert choose_num_splits(64, 8, 4096) == 3  # 8 x 132 programs over 512
        assert choose_num_splits(64, 8, 4096, programs_per_sm=4) == 2
    finally:
        choose_num_splits.cache_clear()


def test_decode_rejects_bad_heads(device: str) -> None:
    cache = torch.zeros(4, 2, 16, 3, 16, device=device)
    q = torch.zeros(1, 4, 16, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q, cache, lens, lens[:, None], 1.0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads", [(8, 8, 64), (32, 8, 128), (32, 4, 128)], ids=["gqa1", "gqa4", "gqa8"]
)
def test_decode_half_precision(
    make_paged_batch, attention_reference, assert_rel_close, seed, dtype, heads
) -> None:
    _check(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        [1, 33, 700, 1500, 2049],
        heads,
        16,
        dtype,
        "cuda",
        seed,
        None,
        1e-2,
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch_size", [1, 64])
def test_decode_llama3_8b(
    make_paged_batch, attention_reference, assert_rel_close, batch_size
) -> None:
    g = torch.Generator().manual_seed(batch_size)
    seq_lens = torch.randint(1, 4097, (batch_size,), generator=g).tolist()
    _check(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        seq_lens,
        (32, 8, 128),
        16,
        torch.bfloat16,
        "cuda",
        batch_size,
        None,
        1e-2,
    )


def _check_groups(
    make_paged_batch,
    attention_reference,
    assert_rel_close,
    shapes: list[tuple[int, int]],
    heads: tuple[int, int, int],
    max_group: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    num_splits: int | None,
    tol: float,
) -> None:
    """Each (cached, new) sequence's new tokens as a group of decode rows (seq_lens rising by one,
    the sequence's block table on every row), against causal attention over the same cache."""
    head_dim = heads[2]
    batch = make_paged_batch(shapes, *heads, 16, dtype, device, seed)
    md = batch.metadata
    lens, tables, groups = [], [], []
    for i, (cached, new) in enumerate(shapes):
        lens += [cached + j + 1 for j in range(new)]
        tables += [md.block_tables[i]] * new
        groups += [new] + [0] * (new - 1)
    scale = head_dim**-0.5
    want = attention_reference(batch, scale)
    row_groups = torch.tensor(groups, dtype=torch.int32, device=device)
    # Grouped, then the same rows one by one (no groups): both agree with the reference.
    for grouping in ({"row_groups": row_groups, "max_group": max_group}, {}):
        got = decode_attention(
            batch.q,
            batch.kv_cache,
            torch.tensor(lens, dtype=torch.int32, device=device),
            torch.stack(tables),
            scale,
            num_splits=num_splits,
            max_seq_len=md.max_seq_len,
            **grouping,
        )
        assert_rel_close(got, want, tol)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "heads", [(3, 1, 16), (4, 2, 32), (8, 1, 64)], ids=["gqa3-d16", "gqa2-d32", "gqa8-d64"]
)
@pytest.mark.parametrize(
    "shapes,max_group,num_splits",
    [
        # Verifications of 4 drafts beside plain decodes (groups of 1) and a short one.
        ([(40, 5), (0, 1), (300, 5), (7, 3)], 5, 4),
        # One long context, 8 drafts; a group straddling a tile and a split boundary.
        ([(123, 9)], 9, None),
        ([(60, 4), (1, 2)], 5, 1),  # one split: stage 1 writes the output
    ],
    ids=["mixed-split4", "one-auto", "few-split1"],
)
def test_decode_row_groups_match_causal_attention(
    make_paged_batch,
    attention_reference,
    assert_rel_close,
    seed,
    heads,
    shapes,
    max_group,
    num_splits,
    device,
) -> None:
    _check_groups(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        shapes,
        heads,
        max_group,
        torch.float32,
        device,
        seed,
        num_splits,
        1e-5,
    )


def test_decode_row_groups_reject_bad_shapes(device: str) -> None:
    cache = torch.zeros(4, 2, 16, 1, 16, device=device)
    q = torch.zeros(2, 2, 16, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="row_groups"):
        decode_attention(q, cache, lens, tables, 1.0, row_groups=lens[:1], max_group=2)
    with pytest.raises(ValueError, match="max_group"):
        decode_attention(q, cache, lens, tables, 1.0, row_groups=lens, max_group=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)], ids=["smollm2", "llama8b"])
def test_decode_row_groups_half_precision(
    make_paged_batch, attention_reference, assert_rel_close, seed, dtype, heads
) -> None:
    _check_groups(
        make_paged_batch,
        attention_reference,
        assert_rel_close,
        [(3000, 5), (0, 1), (700, 5), (2047, 9), (15, 1)],
        heads,
        9,
        dtype,
        "cuda",
        seed,
        None,
        1e-2,
    )
