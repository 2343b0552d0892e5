"""The one-launch MoE router (ember/kernels/moe_routing.py) against the torch routing it replaces
(softmax_topk, grouped_topk) on fresh random logits and correction biases: expert counts that are
and are not powers of two, one group and several (some kept), top-1 to top-8, renormalized or not."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.moe_routing import route
from ember.models.layers.moe import grouped_topk, softmax_topk

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _sorted(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (expert, weight) pairs in expert order (top-k order is not part of a route)."""
    experts = experts.long().cpu()
    order = experts.argsort(dim=-1)
    return experts.gather(1, order), weights.cpu().gather(1, order)


def _same_route(got, want) -> None:
    got_e, got_w = _sorted(*got)
    want_e, want_w = _sorted(*want)
    assert torch.equal(got_e, want_e)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (12, 1), (128, 8), (60, 4)])
def test_softmax_route_matches_softmax_topk(experts: int, top_k: int, renormalize: bool) -> None:
    g = torch.Generator().manual_seed(experts)
    logits = torch.randn(33, experts, generator=g) * 3
    want = softmax_topk(logits, top_k, renormalize)  # CPU: the torch reference
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = route(logits.to(dev), top_k, sigmoid=False, renormalize=renormalize)
    assert got[1].dtype == torch.int32 and got[0].dtype == torch.float32
    _same_route(got, want)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    "experts,groups,kept,top_k",
    [(64, 1, 1, 6), (16, 4, 2, 4), (12, 3, 1, 2), (256, 8, 4, 8), (384, 1, 1, 8), (8, 8, 3, 2)],
    ids=["moonlight", "tiny-groups", "uneven-groups", "deepseek-v3", "kimi-k2", "one-per-group"],
)
def test_sigmoid_route_matches_grouped_topk(
    experts: int, groups: int, kept: int, top_k: int, renormalize: bool
) -> None:
    g = torch.Generator().manual_seed(experts + top_k)
    logits = torch.randn(21, experts, generator=g)
    bias = torch.randn(experts, generator=g) * 0.5
    want = grouped_topk(logits, bias, top_k, groups, kept, renormalize, 2.5)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = route(
        logits.to(dev),
        top_k,
        sigmoid=True,
        renormalize=renormalize,
        correction_bias=bias.to(dev),
        num_groups=groups,
        topk_groups=kept,
        scaling=2.5,
    )
    _same_route(got, want)


@pytest.mark.parametrize("num_shared", [1, 2])
def test_route_appends_the_shared_experts(num_shared: int) -> None:
    """Shared experts ride along as experts E.. with weight 1 after the routed k, unscaled and
    outside the renormalization, as grouped_topk appends them."""
    g = torch.Generator().manual_seed(num_shared)
    logits = torch.randn(9, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.5
    want = grouped_topk(logits, bias, 3, 4, 2, True, 2.5, num_shared=num_shared)
    assert want[1].shape == (9, 3 + num_shared)
    assert torch.equal(want[1][:, 3:], torch.arange(16, 16 + num_shared).expand(9, -1))
    assert torch.equal(want[0][:, 3:], torch.ones(9, num_shared))
    torch.testing.assert_close(want[0][:, :3].sum(-1), torch.full((9,), 2.5))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = route(
        logits.to(dev),
        3,
        sigmoid=True,
        renormalize=True,
        correction_bias=bias.to(dev),
        num_groups=4,
        topk_groups=2,
        scaling=2.5,
        num_shared=num_shared,
    )
    _same_route(got, want)


def test_route_of_no_tokens() -> None:
    w, e = route(torch.zeros(0, 8), 2, sigmoid=False, renormalize=True)
    assert w.shape == (0, 2) and e.shape == (0, 2)


@pytest.mark.parametrize(
    "tokens,experts,hidden", [(1, 64, 2048), (5, 20, 72), (33, 384, 160), (2, 12, 9000)]
)
def test_router_logits_match_the_fp32_linear(tokens: int, experts: int, hidden: int) -> None:
    """bf16 activations against the float32 router weight, computed in float32 as
    F.linear(x.float(), weight): token and expert counts no tile divides, Kimi K2's 384 experts."""
    from ember.kernels.moe_routing import router_logits

    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w = torch.randn(experts, hidden, generator=g) / hidden**0.5
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = router_logits(x.to(dev), w.to(dev))
    assert got.dtype == torch.float32 and got.shape == (tokens, experts)
    torch.testing.assert_close(got.cpu(), torch.nn.functional.linear(x.float(), w))
    with pytest.raises(ValueError, match="router weight"):
        router_logits(x.to(dev), w.to(dev).bfloat16())
