"""Tensor-parallel dense models and layers on the CPU: Llama, Qwen2 and Qwen3 (tied embeddings)
over 2 and 4 gloo ranks give one rank's logits, through a prefill of two sequences and two decode
steps on the paged KV cache (4 heads, 2 KV heads: 4 ranks replicate each KV head on 2); so does
an INT4 llama over 2 ranks. The layers' slices are checked in one process (a state without a
group: column slices are concatenated, row slices' partial sums added by hand), and the
refusals name what does not divide."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ember.attention.context import ForwardContext
from ember.attention.metadata import AttentionMetadata
from ember.attention.torch_backend import TorchAttentionBackend
from ember.distributed import state
from ember.distributed.state import ParallelState
from ember.models.config import kv_cache_shape
from ember.models.layers.linear import Linear, StackedLinear, make_linear
from ember.models.layers.parallel import rank_slice
from ember.models.layers.quant_linear import QuantLinear
from ember.models.layers.vocab_parallel import (
    ParallelLMHead,
    VocabParallelEmbedding,
    gather_logits,
)
from ember.models.loader import build_model, load_model
from ember.models.quant_config import WeightQuant
from tests.distributed.ranks import run_ranks
from tests.models.quant_checkpoints import make_quantized

ARCHS = ["llama", "qwen2", "qwen3"]
QUANT_CASE = "llama_w4a16_g32"
"""INT4 in groups of 32: 2 ranks hold o_proj's 32 of 64 inputs (whole groups), 4 would cut them."""
BLOCK = 4
PROMPTS = [[5, 17, 301, 2048, 9], [7, 1, 3071, 44, 45, 46, 1000]]
DECODES = [[11, 2900], [512, 13]]
"""The tokens the two decode steps feed (fixed, not sampled: the ranks' logits are compared)."""
TOL = {"atol": 1e-4, "rtol": 1e-4}


def _metadata(
    query_lens: list[int], seq_lens: list[int], tables: torch.Tensor, decodes: int
) -> AttentionMetadata:
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    slots = [
        int(tables[i, pos // BLOCK]) * BLOCK + pos % BLOCK
        for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True))
        for pos in range(s - q, s)
    ]
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decodes=decodes,
    )


def step_logits(model: torch.nn.Module) -> list[torch.Tensor]:
    """The logits of every row of the prefill and of the two decode steps."""
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    kv = torch.zeros(kv_cache_shape(model.config, 6, BLOCK))  # this rank's KV heads
    backend = TorchAttentionBackend()
    lens = [len(p) for p in PROMPTS]
    ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    md = _metadata(lens, lens, tables, 0)
    out = []
    with torch.no_grad():
        out.append(model.compute_logits(model(ids, positions, ForwardContext(md, kv, backend))))
        for tokens in DECODES:
            positions = torch.tensor(lens)
            lens = [n + 1 for n in lens]
            md = _metadata([1, 1], lens, tables, 2)
            hidden = model(torch.tensor(tokens), positions, ForwardContext(md, kv, backend))
            out.append(model.compute_logits(hidden))
    return out


def rank_logits(paths: list[str]) -> list[list[np.ndarray]]:
    """One rank's `step_logits` of each checkpoint (every rank has the whole vocabulary's), as
    arrays: torch hands a tensor to another process in shared memory the rank's exit may free
    before it is read."""
    return [[t.numpy() for t in step_logits(load_model(p, dtype=torch.float32))] for p in paths]


@pytest.fixture(scope="module")
def quant_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, quantized, _ = make_quantized(tmp_path_factory.mktemp(QUANT_CASE), QUANT_CASE, seed=7)
    return quantized


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_give_one_ranks_logits(size: int, tiny_model_dir, quant_dir: Path) -> None:
    paths = [str(tiny_model_dir(arch)) for arch in ARCHS]
    if size == 2:
        paths.append(str(quant_dir))
    want = rank_logits(paths)
    for rank, got in enumerate(run_ranks(size, rank_logits, paths)):
        for path, steps, ref in zip(paths, got, want, strict=True):
            for step, (g, w) in enumerate(zip(steps, ref, strict=True)):
                assert g.shape == w.shape, (rank, path, step)
                np.testing.assert_allclose(g, w, **TOL, err_msg=f"rank {rank}, {path}, step {step}")


def test_one_rank_is_the_replicated_model(tiny_model_dir) -> None:
    """Built on one rank, the layers are the plain ones at the checkpoint's sizes."""
    model = build_model(tiny_model_dir("qwen3"), dtype=torch.float32, load_format="dummy")
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (4, 2)
    assert type(attn.o_proj) is Linear and not attn.o_proj.partial
    assert tuple(attn.qkv_proj.weight.shape) == (128, 64)
    assert tuple(model.model.embed_tokens.weight.shape) == (3072, 64)
    assert model.lm_head.weight is model.model.embed_tokens.weight


# -- the layers' slices, in one process ----------------------------------------------------------


def _ranks(size: int) -> list[ParallelState]:
    return [ParallelState(rank=r, size=size) for r in range(size)]


def test_column_slices_with_explicit_rows_and_replicated_kv() -> None:
    g = torch.Generator().manual_seed(0)
    parts = {"q": 8, "k": 4, "v": 4}
    full = {p: torch.randn(n, 6, generator=g) for p, n in parts.items()}
    bias = {p: torch.randn(n, generator=g) for p, n in parts.items()}
    x = torch.randn(3, 6, generator=g)
    # 4 ranks, 4 q rows of 2 each... k and v of 2 "heads" of 2 rows, each held by 2 ranks.
    outs = []
    for s in _ranks(4):
        kv = (s.rank // 2 * 2, s.rank // 2 * 2 + 2)
        rows = {"q": (2 * s.rank, 2 * s.rank + 2), "k": kv, "v": kv}
        with state.use(s):
            layer = make_linear(6, parts, None, "qkv", bias=True, parallel="column", rows=rows)
        assert isinstance(layer, StackedLinear) and layer.shard_sizes == {"q": 2, "k": 2, "v": 2}
        for p in parts:
            layer.weight_loader(layer.weight, full[p], p)
            layer.weight_loader(layer.bias, bias[p], p)
        assert layer.missing_shards("weight") == [] and layer.missing_shards("bias") == []
        outs.append(layer.split(layer(x)))
    want = {p: F.linear(x, full[p], bias[p]) for p in parts}
    torch.testing.assert_close(torch.cat([o[0] for o in outs], -1), want["q"])
    for r, (_, k, v) in enumerate(outs):
        kv = slice(r // 2 * 2, r // 2 * 2 + 2)
        torch.testing.assert_close(k, want["k"][:, kv])
        torch.testing.assert_close(v, want["v"][:, kv])


def test_row_slices_sum_with_the_bias_once() -> None:
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(5, 8, generator=g), torch.randn(5, generator=g), torch.randn(3, 8)
    total = torch.zeros(3, 5)
    for s in _ranks(2):
        with state.use(s):
            layer = make_linear(8, 5, None, "down", bias=True, parallel="row", reduce=False)
        assert tuple(layer.weight.shape) == (5, 4) and layer.partial
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
        total += layer(x[:, 4 * s.rank : 4 * s.rank + 4])  # a row-parallel rank's inputs
    torch.testing.assert_close(total, F.linear(x, w, b))


def _int4_tensors(n: int, k: int, group: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    values = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int64)
    return {
        "weight_packed": values.to(torch.int32),
        "weight_scale": torch.rand(n, k // group, generator=g) / 50,
        "weight_zero_point": torch.randint(-(2**31), 2**31 - 1, (-(-n // 8), k // group)).to(
            torch.int32
        ),
    }


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_int4_slices(parallel: str) -> None:
    """Asymmetric INT4 in groups of 16: packed words, scales and zero points (packed down the
    rows) sliced alike; the ranks' outputs make the whole layer's."""
    quant = WeightQuant("int", bits=4, group_size=16, symmetric=False)
    n, k = 24, 64
    tensors = _int4_tensors(n, k, 16)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3))
    whole = QuantLinear(k, {"": n}, quant, "w")
    for attr, t in tensors.items():
        whole.load(attr, t, "", attr)
    want = whole(x)
    outs = []
    for s in _ranks(2):
        with state.use(s):
            rs = rank_slice(k, {"": n}, "w", parallel, reduce=False)  # type: ignore[arg-type]
            layer = QuantLinear(k, {"": n}, quant, "w", rank_slice=rs)
        for attr, t in tensors.items():
            layer.load(attr, t, "", attr)
        c0, c1 = rs.cols
        outs.append(layer(x[:, c0:c1]))
    got = torch.cat(outs, -1) if parallel == "column" else outs[0] + outs[1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp8_block_rows_cut_inside_a_block_take_per_row_scales() -> None:
    """FP8 in 4x8 blocks, q/k/v of 8/4/4 rows over 2 ranks: k's and v's 2 rows a rank start
    inside a block row; each row gets its block's scale."""
    quant = WeightQuant("fp8", block=(4, 8))
    g = torch.Generator().manual_seed(4)
    parts = {"q": 8, "k": 4, "v": 4}
    w = {
        p: (torch.randn(n, 16, generator=g) * 10).to(torch.float8_e4m3fn) for p, n in parts.items()
    }
    sc = {p: torch.rand(-(-n // 4), 2, generator=g) + 0.5 for p, n in parts.items()}
    x = torch.randn(3, 16, generator=g)
    whole = QuantLinear(16, parts, quant, "qkv")
    for p in parts:
        whole.load("weight", w[p], p, "weight")
        whole.load("weight_scale", sc[p], p, "weight_scale")
    want = whole.split(whole(x))
    outs = []
    for s in _ranks(2):
        with state.use(s):
            rs = rank_slice(16, parts, "qkv", "column")
            layer = QuantLinear(16, parts, quant, "qkv", rank_slice=rs)
        assert layer.block[0] == 1
        for p in parts:
            layer.load("weight", w[p], p, "weight")
            layer.load("weight_scale", sc[p], p, "weight_scale")
        outs.append(layer.split(layer(x)))
    for i in range(3):
        torch.testing.assert_close(torch.cat([o[i] for o in outs], -1), want[i])


def test_vocab_padded_across_ranks() -> None:
    """A vocabulary of 10 over 4 ranks: 3 rows each, the last rank's 1 id and 2 zero rows; the
    lookups sum to the embedding and the gathered logits trim to the vocabulary."""
    g = torch.Generator().manual_seed(5)
    table, hidden = torch.randn(10, 6, generator=g), torch.randn(2, 6, generator=g)
    ids = torch.tensor([0, 2, 3, 9, 5, 6])
    looked, logits = torch.zeros(6, 6), []
    for s in _ranks(4):
        with state.use(s):
            embed = VocabParallelEmbedding(10, 6)
            head = ParallelLMHead(6, 10)
        embed.weight_loader(embed.weight, table)
        head.weight_loader(head.weight, table)
        assert tuple(embed.weight.shape) == (3, 6)
        looked += embed(ids)
        logits.append(head(hidden))
    torch.testing.assert_close(looked, table[ids])
    assert torch.equal(embed.weight[1:], torch.zeros(2, 6))
    # gather_logits concatenates the ranks' slices and trims the padding, as here:
    torch.testing.assert_close(torch.cat(logits, -1)[:, :10], hidden @ table.T)
    assert gather_logits(logits[0], 10) is logits[0]  # one rank: untouched


# -- refusals ---------------------------------------------------------------------------------------


def test_heads_the_ranks_do_not_divide_are_refused(tiny_model_dir) -> None:
    with (
        state.use(ParallelState(rank=0, size=3)),
        pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by .* \(3\)"),
    ):
        build_model(tiny_model_dir("llama"), dtype=torch.float32, load_format="dummy")


def test_a_row_slice_cutting_int_groups_is_refused(quant_dir: Path) -> None:
    """4 ranks would hold 16 of o_proj's 64 inputs, half a group of 32."""
    with (
        state.use(ParallelState(rank=1, size=4)),
        pytest.raises(
            ValueError,
            match=r"layers\.0\.self_attn\.o_proj\.weight_scale: this rank's inputs \[16, 32\) "
            r"of 64 cut its groups of 32 inputs",
        ),
    ):
        build_model(quant_dir, dtype=torch.float32)


def test_unknown_parallel_and_stray_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="parallel must be"):
        make_linear(4, 4, None, "x", parallel="diagonal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="x: explicit rows are for a column-parallel layer"):
        make_linear(4, 4, None, "x", parallel="row", rows=(0, 2))
    with (
        state.use(ParallelState(rank=0, size=3)),
        pytest.raises(
            ValueError, match=r"x's rows \(4\) is not divisible by the tensor-parallel size \(3\)"
        ),
    ):
        make_linear(4, 4, None, "x", parallel="column")
