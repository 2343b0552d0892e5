"""The fused MoE kernels under expert parallel (`foreign=True`): the model's experts split in
two ranks' halves, each rank's routes mapped to its local ids (id E_local for the other rank's
experts); each rank's output is its experts' share and the two sum to the whole layer's (the
per-expert loop over every expert). Each rank's stacked weights are followed in memory by an
expert of NaNs, so a kernel that read past its experts (a foreign pair's id) poisons the output.
Every path: bf16-layout dense experts sorted and unsorted, packed INT on the CUDA-core decode
GEMVs (K whole and split) and the grouped GEMM, FP8 blocks; fp32 in the interpreter."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.fused_moe import fused_moe, fused_moe_fp8, fused_moe_int
from ember.kernels.quant_ref import routed_experts_fp8_ref
from ember.models.layers.moe import routed_experts_ref
from tests.kernels.test_fused_moe import SMALL, _route, _weights
from tests.kernels.test_fused_moe_quant import (
    DECODE,
    FP8_DECODE,
    FP8_SMALL,
    _fp8_experts,
    _int_case,
)


def _local(chosen: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Global routes as rank-local ids: [first, first + n) -> 0.., others -> n."""
    inside = (chosen >= first) & (chosen < first + n)
    return torch.where(inside, chosen - first, torch.full_like(chosen, n))


def _poisoned(t: torch.Tensor | None, first: int, n: int) -> torch.Tensor | None:
    """Experts [first, first + n) of stacked `t`, with one more expert after them in memory:
    NaN (float) or its type's largest value (int), which no correct kernel reads."""
    if t is None:
        return None
    out = torch.empty(n + 1, *t.shape[1:], dtype=t.dtype)
    out[:n] = t[first : first + n]
    fill = float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).max
    out[n] = fill if t.dtype != torch.float8_e4m3fn else torch.nan
    return out[:n]


def _two_ranks(run, chosen: torch.Tensor, experts: int, want: torch.Tensor) -> None:
    half = experts // 2
    outs = [run(first, half, _local(chosen, first, half)) for first in (0, half)]
    for out in outs:
        assert torch.isfinite(out).all()
    got = outs[0].double() + outs[1].double()
    err = (got - want.double()).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err


@pytest.mark.parametrize("kind", ["random", "one-expert"])
@pytest.mark.parametrize("tokens", [1, 2, 37])
def test_dense_experts_split_by_expert_sum_to_the_layer(tokens: int, kind: str) -> None:
    g = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter = 8, 3, 40, 24
    w13, w2 = _weights(experts, hidden, inter, g)
    x = torch.randn(tokens, hidden, generator=g)
    weights, chosen = _route(kind, tokens, experts, top_k, g)
    want = routed_experts_ref(x.double(), w13.double(), w2.double(), weights.double(), chosen)

    def run(first: int, n: int, local: torch.Tensor) -> torch.Tensor:
        a, b = _poisoned(w13, first, n), _poisoned(w2, first, n)
        return fused_moe(x, a, b, weights, local, config=SMALL, foreign=True)

    _two_ranks(run, chosen, experts, want)


@pytest.mark.parametrize(
    "tokens,config",
    [(1, DECODE), (2, {**DECODE, "SPLIT_TARGET": 1000}), (5, SMALL)],
    ids=["decode", "decode-split-k", "grouped-gemm"],
)
@pytest.mark.parametrize("bits,group,zero", [(4, 32, True), (8, 0, False)])
def test_int_experts_split_by_expert_sum_to_the_layer(
    bits: int, group: int, zero: bool, tokens: int, config: dict
) -> None:
    shape = (tokens, 8, 3, 128, 64)
    args, want, _ = _int_case(shape, (bits, group, zero), "random", torch.float32, 50 + tokens)
    x, p13, s13, z13, p2, s2, z2, weights, chosen, bits, group = args

    def run(first: int, n: int, local: torch.Tensor) -> torch.Tensor:
        mine = [_poisoned(t, first, n) for t in (p13, s13, z13, p2, s2, z2)]
        return fused_moe_int(x, *mine, weights, local, bits, group, config, foreign=True)

    _two_ranks(run, chosen, 8, want)


@pytest.mark.parametrize(
    "tokens,tiles", [(1, "tensor-cores"), (5, "tensor-cores"), (1, "decode"), (2, "decode")]
)
def test_fp8_experts_split_by_expert_sum_to_the_layer(tokens: int, tiles: str) -> None:
    g = torch.Generator().manual_seed(60 + tokens)
    experts, top_k, hidden, inter, block = 8, 3, 64, 32, (16, 32)
    w13, s13 = _fp8_experts(experts, 2 * inter, hidden, block, g)
    w2, s2 = _fp8_experts(experts, hidden, inter, block, g)
    x = torch.randn(tokens, hidden, generator=g)
    weights, chosen = _route("random", tokens, experts, top_k, g)
    want = routed_experts_fp8_ref(x, w13, s13, w2, s2, weights, chosen, block)

    def run(first: int, n: int, local: torch.Tensor) -> torch.Tensor:
        mine = [_poisoned(t, first, n) for t in (w13, s13, w2, s2)]
        config = FP8_SMALL if tiles == "tensor-cores" else FP8_DECODE
        return fused_moe_fp8(x, *mine, weights, local, block, config, foreign=True)

    _two_ranks(run, chosen, experts, want)
