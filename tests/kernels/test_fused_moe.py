"""The fused MoE grouped GEMM (ember/kernels/fused_moe.py) against the per-expert loop on fresh
random inputs: random routes, every token to one expert (imbalance), experts no token chose
(empty), one and two tokens (the unsorted path: a block a pair), k of 1, and dims no tile
divides; fp32 in the interpreter, bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.fused_moe import align_by_expert, fused_moe, tile_config
from ember.models.layers.moe import routed_experts_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Small tiles so the interpreter's few rows still span several blocks and tiles per expert.
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}


def _weights(experts: int, hidden: int, inter: int, g: torch.Generator):
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    return w13, w2


def _route(kind: str, tokens: int, experts: int, top_k: int, g: torch.Generator):
    if kind == "random":
        scores = torch.rand(tokens, experts, generator=g)
    elif kind == "one-expert":  # every token's best expert is expert 3
        scores = torch.rand(tokens, experts, generator=g)
        scores[:, 3] += 10
    elif kind == "empty-experts":  # only experts 0..top_k can win; the rest get no token
        scores = torch.rand(tokens, experts, generator=g)
        scores[:, : top_k + 1] += 10
    else:
        raise AssertionError(kind)
    weights, chosen = scores.topk(top_k, dim=-1)
    return torch.rand(tokens, top_k, generator=g) + 0.1, chosen


def _check(tokens, experts, top_k, hidden, inter, kind, dtype, device, seed, config, tol):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = _weights(experts, hidden, inter, g)
    x = torch.randn(tokens, hidden, generator=g)
    weights, chosen = _route(kind, tokens, experts, top_k, g)
    want = routed_experts_ref(x.double(), w13.double(), w2.double(), weights.double(), chosen)
    got = fused_moe(
        x.to(device, dtype),
        w13.to(device, dtype),
        w2.to(device, dtype),
        weights.to(device),
        chosen.to(device),
        config=config,
    )
    assert got.shape == x.shape and got.dtype == dtype
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), err


@pytest.mark.parametrize("kind", ["random", "one-expert", "empty-experts"])
@pytest.mark.parametrize(
    "tokens,experts,top_k,hidden,inter",
    [
        (37, 8, 2, 40, 24),
        (1, 8, 2, 48, 32),
        (2, 8, 3, 40, 24),
        (20, 6, 1, 24, 40),
        (9, 16, 4, 32, 16),
    ],
    ids=["uneven-dims", "one-token", "two-tokens", "top-1", "many-experts"],
)
def test_fused_moe_matches_the_per_expert_loop(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, kind: str, device: str
) -> None:
    _check(tokens, experts, top_k, hidden, inter, kind, torch.float32, device, 0, SMALL, 1e-5)


def test_fused_moe_default_tiles(device: str) -> None:
    """The tile sizes fused_moe picks itself (BLOCK_K past the hidden size, masked)."""
    _check(5, 4, 2, 40, 24, "random", torch.float32, device, 1, None, 1e-5)


@pytest.mark.parametrize("kind", ["random", "one-expert", "empty-experts"])
def test_align_by_expert_places_every_pair_once_in_its_experts_blocks(
    kind: str, device: str
) -> None:
    g = torch.Generator().manual_seed(2)
    tokens, experts, top_k, block = 23, 8, 3, 4
    _, chosen = _route(kind, tokens, experts, top_k, g)
    pairs, block_experts = (t.cpu() for t in align_by_expert(chosen.to(device), experts, block))
    n = tokens * top_k
    assert pairs.numel() == block_experts.numel() * block
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n))  # each pair exactly once
    assert (pairs[pairs >= n] == n).all()  # the rest is padding
    flat = chosen.reshape(-1)
    for b, e in enumerate(block_experts.tolist()):
        rows = pairs[b * block : (b + 1) * block]
        rows = rows[rows < n]
        if e == experts:
            assert rows.numel() == 0  # past the last run
        else:
            assert rows.numel() > 0 and (flat[rows.long()] == e).all()
    # Every expert with tokens has whole blocks of its own; the used blocks come first.
    used = (block_experts < experts).sum().item()
    assert (block_experts[:used] < experts).all()
    counts = torch.bincount(flat, minlength=experts)
    assert used == sum(-(-c // block) for c in counts.tolist())


def test_fused_moe_refuses_mismatched_shapes() -> None:
    w13, w2 = torch.zeros(4, 8, 6), torch.zeros(4, 6, 4)
    with pytest.raises(ValueError, match="w13"):
        fused_moe(
            torch.zeros(3, 5), w13, w2, torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="must both be"):
        fused_moe(
            torch.zeros(3, 6), w13, w2, torch.zeros(3, 2), torch.zeros(2, 2, dtype=torch.long)
        )


def test_tile_config_grows_with_rows_per_expert() -> None:
    assert tile_config(8, 64)["BLOCK_M"] == 16
    assert tile_config(256 * 8, 128)["BLOCK_M"] <= 32
    assert tile_config(8192 * 8, 128)["BLOCK_M"] == 128


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "one-expert", "empty-experts"])
@pytest.mark.parametrize("tokens", [1, 2, 3, 64, 1000])
def test_fused_moe_bf16_on_the_gpu(tokens: int, kind: str) -> None:
    """Moonlight-like expert dims (H 2048, I 1408, 64 experts, top 6) with the chosen tiles."""
    _check(tokens, 64, 6, 2048, 1408, kind, torch.bfloat16, "cuda", 3, None, 2e-2)


@needs_cuda
@pytest.mark.gpu
def test_fused_moe_is_captured_in_a_cuda_graph() -> None:
    g = torch.Generator().manual_seed(4)
    w13, w2 = (w.cuda().bfloat16() for w in _weights(16, 256, 128, g))
    x = torch.randn(32, 256, generator=g).cuda().bfloat16()
    weights = torch.rand(32, 2, generator=g).cuda()
    chosen = torch.randint(0, 16, (32, 2), generator=g).cuda()
    for t in (1, 32):  # unsorted (a block a pair) and sorted by expert
        fused_moe(x[:t], w13, w2, weights[:t], chosen[:t])  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe(x[:t], w13, w2, weights[:t], chosen[:t])
        chosen.copy_(torch.randint(0, 16, (32, 2), generator=g).cuda())
        x.copy_(torch.randn(32, 256, generator=g).cuda().bfloat16())
        graph.replay()
        torch.testing.assert_close(out, fused_moe(x[:t], w13, w2, weights[:t], chosen[:t]))


@pytest.mark.parametrize("k,t,hidden", [(1, 3, 40), (8, 1, 2048), (6, 37, 24)])
def test_sum_slabs_equals_torch_sum(k: int, t: int, hidden: int, device: str) -> None:
    from ember.kernels.fused_moe import sum_slabs

    y = torch.randn(k, t, hidden, generator=torch.Generator().manual_seed(k + t))
    got = sum_slabs(y.to(device))
    torch.testing.assert_close(got.cpu(), y.sum(0), atol=1e-5, rtol=1e-5)
