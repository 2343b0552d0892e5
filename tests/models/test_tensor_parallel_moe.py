"""MoE and MLA models on a tensor-parallel engine, in gloo processes on the CPU: Qwen3-MoE with
experts split by width (TP 2) and by expert (EP 2, EP 4), DeepSeek-V3 with MLA's heads split
(TP 2) and its experts by expert (TP 2 + EP 2), and Kimi K2.5's scheme (INT4 routed experts, a
16-bit shared MLP) by expert, each equal to one rank's logits (float32, 1e-4) over a prefill of
two sequences and two decode steps through the paged KV cache. Under expert parallel the ranks'
expert-load counters sum to the step's tokens times top k a layer. Quantized experts split by
width load consistently (the two ranks' partial sums are the whole layer's); splits that cut
experts, INT groups or FP8 blocks are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ember.attention.context import ForwardContext
from ember.attention.metadata import AttentionMetadata
from ember.attention.torch_backend import TorchAttentionBackend
from ember.distributed import state
from ember.distributed.state import ParallelState
from ember.kernels.quant_ref import pack_int
from ember.models.config import kv_cache_shape
from ember.models.layers.moe import FusedMoE
from ember.models.layers.quant_moe import QuantFusedMoE
from ember.models.loader import load_model
from ember.models.quant_config import WeightQuant
from ember.models.tiny import make_tiny
from tests.distributed.ranks import run_ranks
from tests.models.quant_checkpoints import make_quantized

BLOCK = 4
PROMPTS = [5, 7]  # two sequences' prompt lengths
DECODES = 2
TOKENS = sum(PROMPTS) + DECODES * len(PROMPTS)  # tokens through every layer


def _metadata(starts: list[int], counts: list[int]) -> AttentionMetadata:
    """Sequence i's `counts[i]` new tokens at positions starts[i].., its KV in blocks
    [3i, 3i + 3)."""
    tables = torch.tensor([[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(starts))])
    qsl, slots = [0], []
    for i, (s, n) in enumerate(zip(starts, counts, strict=True)):
        qsl.append(qsl[-1] + n)
        slots += [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(s, s + n)]
    lens = [s + n for s, n in zip(starts, counts, strict=True)]
    decode = all(n == 1 for n in counts)
    return AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        tables.to(torch.int32),
        torch.tensor(slots, dtype=torch.int64),
        max(counts),
        max(lens),
        qsl,
        lens,
        num_decodes=len(counts) if decode else 0,
    )


def _steps() -> list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]:
    """The prefill of both prompts, then DECODES steps of one token each (fixed ids, not
    sampled, so that every run feeds the same tokens)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 3000, (TOKENS,), generator=g)
    pos = torch.cat([torch.arange(n) for n in PROMPTS])
    steps = [(ids[: sum(PROMPTS)], pos, _metadata([0, 0], PROMPTS))]
    used = sum(PROMPTS)
    for d in range(DECODES):
        starts = [n + d for n in PROMPTS]
        steps.append((ids[used : used + 2], torch.tensor(starts), _metadata(starts, [1, 1])))
        used += 2
    return steps


def run_model(path: str) -> dict[str, Any]:
    """This rank's logits of every step and its expert load (a rank's process, or one rank), as
    NumPy arrays: they pickle by value, where a tensor from a rank's process is shared through a
    descriptor that may close with the process before it is read."""
    model = load_model(path, dtype=torch.float32)
    cache = torch.zeros(kv_cache_shape(model.config, 3 * len(PROMPTS), BLOCK))
    logits = []
    with torch.no_grad():
        for ids, positions, md in _steps():
            ctx = ForwardContext(md, cache, TorchAttentionBackend())
            logits.append(model.compute_logits(model(ids, positions, ctx)).numpy())
    load = model.expert_load()
    return {"logits": logits, "load": None if load is None else load.numpy()}


def _check(path: Path, size: int, expert_parallel: bool) -> None:
    want = run_model(str(path))
    assert want["load"] is None  # one rank counts nothing
    ranks = run_ranks(size, run_model, str(path), expert_parallel=expert_parallel)
    for got in ranks:
        for g, w in zip(got["logits"], want["logits"], strict=True):
            torch.testing.assert_close(
                torch.from_numpy(g), torch.from_numpy(w), atol=1e-4, rtol=1e-4
            )
    if expert_parallel:
        loads = [r["load"] for r in ranks]
        layers, experts = loads[0].shape
        assert all(x.shape == (layers, experts) for x in loads) and experts * size == 8
        top_k = 2
        per_layer = sum(x.sum(axis=1) for x in loads)
        assert per_layer.tolist() == [TOKENS * top_k] * layers
    else:
        assert all(r["load"] is None for r in ranks)


@pytest.mark.parametrize(
    ("size", "expert_parallel"), [(2, False), (2, True), (4, True)], ids=["tp2", "ep2", "ep4"]
)
def test_qwen3_moe_equals_one_rank(tiny_model_dir, size: int, expert_parallel: bool) -> None:
    _check(tiny_model_dir("qwen3_moe"), size, expert_parallel)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep2"])
def test_deepseek_v3_mla_heads_split_equals_one_rank(tiny_model_dir, expert_parallel) -> None:
    _check(tiny_model_dir("deepseek_v3"), 2, expert_parallel)


def test_deepseek_v3_plain_q_proj_split_by_heads_in_the_fused_projection(tmp_path) -> None:
    """No q LoRA: q_proj's rows of the rank's heads and the whole latent projection are one
    column-parallel layer."""
    path = make_tiny(tmp_path, "deepseek_v3", overrides={"q_lora_rank": None})
    _check(path, 2, False)


@pytest.fixture(scope="module")
def kimi_int4(tmp_path_factory) -> Path:
    return make_quantized(tmp_path_factory.mktemp("kimi-int4"), "kimi_k2_int4")[1]


def test_kimi_int4_experts_by_expert_equal_one_rank(kimi_int4: Path) -> None:
    _check(kimi_int4, 2, True)


def _refused_build(path: str) -> str:
    try:
        load_model(path, dtype=torch.float32)
    except ValueError as e:
        return str(e)
    return ""


def test_kimi_int4_experts_by_width_refuse_a_cut_group(kimi_int4: Path) -> None:
    """moe_intermediate_size 32 in two ranks' 16 columns: w2's groups of 32 would be cut."""
    with state.use(ParallelState(0, 2)):
        message = _refused_build(str(kimi_int4))
    assert "mlp.experts.*.down_proj.weight_scale" in message and "groups of 32" in message


def test_expert_parallel_refuses_experts_the_ranks_do_not_divide() -> None:
    with state.use(ParallelState(0, 3, expert_parallel=True)):
        with pytest.raises(ValueError, match="8 routed experts do not split"):
            FusedMoE(8, 2, 16, 32, renormalize=True)
        with pytest.raises(ValueError, match="shared experts apart"):
            FusedMoE(6, 2, 16, 32, renormalize=True, num_shared=1)
    with state.use(ParallelState(0, 3)), pytest.raises(ValueError, match="moe_intermediate_size"):
        FusedMoE(8, 2, 16, 32, renormalize=True)


def test_fp8_experts_by_width_refuse_a_cut_block() -> None:
    fp8 = WeightQuant("fp8", 8, block=(128, 128))
    with state.use(ParallelState(1, 4)), pytest.raises(ValueError, match="128x128 blocks"):
        QuantFusedMoE(8, 2, 256, 256, True, fp8, "model.layers.1.mlp.experts")


# Quantized experts split by width, one layer at a time: each rank loads the whole checkpoint
# tensors and keeps its width; the ranks' partial sums (the MoE block all-reduces them) are the
# one-rank layer's output.
HIDDEN, INTER, E = 64, 128, 4


def _int_tensors(g: torch.Generator, rows: int, k: int, group: int) -> dict[str, torch.Tensor]:
    q = torch.randint(-8, 8, (rows, k), generator=g, dtype=torch.int8)
    return {
        "weight_packed": pack_int(q, 4),
        "weight_scale": torch.rand(rows, k // group, generator=g) * 0.05 + 0.01,
        "weight_shape": torch.tensor([rows, k]),
    }


def _fp8_tensors(g: torch.Generator, rows: int, k: int, block: tuple[int, int]):
    w = (torch.randn(rows, k, generator=g) * 0.1).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-rows // block[0]), -(-k // block[1]), generator=g) + 0.5
    return {"weight": w, "weight_scale": scale}


def _layer_tensors(quant: WeightQuant, seed: int) -> list[tuple[str, str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for x in [*range(E), "shared"]:
        for part in ("gate", "up", "down"):
            rows, k = (HIDDEN, INTER) if part == "down" else (INTER, HIDDEN)
            if quant.kind == "int":
                made = _int_tensors(g, rows, k, quant.group_size)
            else:
                made = _fp8_tensors(g, rows, k, quant.block)
            out += [(f"{x}.{part}", attr, t) for attr, t in made.items()]
    return out


def _quant_layer(quant: WeightQuant, tensors) -> QuantFusedMoE:
    layer = QuantFusedMoE(E, 2, HIDDEN, INTER, True, quant, "experts", num_shared=1)
    for shard, attr, t in tensors:
        layer.load(attr, t, shard, f"experts.{shard}.{attr}")
    for w in ("w13", "w2"):
        for p, _ in layer.named_parameters():
            if p.startswith(w):
                assert layer.missing_shards(p) == [], p
    return layer


@pytest.mark.parametrize(
    "quant",
    [
        WeightQuant("int", 4, group_size=32),
        WeightQuant("fp8", 8, block=(32, 32)),
        WeightQuant("fp8", 8, block=(64, 32)),  # 64 gate rows in two ranks' 32 rows: one a row
    ],
    ids=["int4-g32", "fp8-32x32", "fp8-rows-per-row"],
)
def test_quantized_experts_split_by_width_sum_to_the_layer(quant: WeightQuant) -> None:
    tensors = _layer_tensors(quant, 7)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, HIDDEN, generator=g)
    experts = torch.tensor([[0, 4], [1, 3], [2, 4], [0, 1], [3, 4], [2, 0]])  # 4: the shared
    weights = torch.rand(6, 2, generator=g)
    want = _quant_layer(quant, tensors).routed(x, weights, experts)
    parts = []
    for rank in range(2):
        with state.use(ParallelState(rank, 2)):
            layer = _quant_layer(quant, tensors)
        assert len(layer.width) == INTER // 2
        parts.append(layer.routed(x, weights, experts))
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-4, rtol=1e-4)
