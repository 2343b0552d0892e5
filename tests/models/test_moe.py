import pytest
import torch

from ember.models.layers.moe import FusedMoE


def test_dense_graph_safe_path_equals_the_routed_loop() -> None:
    g = torch.Generator().manual_seed(0)
    m = FusedMoE(8, 2, 16, 8, renormalize=True)
    with torch.no_grad():
        m.w13.copy_(torch.randn(m.w13.shape, generator=g))
        m.w2.copy_(torch.randn(m.w2.shape, generator=g))
    for seed in range(3):
        x = torch.randn(7, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
        logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(seed + 10))
        routed = m(x, logits)  # CPU: the per-expert loop
        probs = torch.softmax(logits, -1)
        w, e = torch.topk(probs, 2)
        dense = m._dense(x, w / w.sum(-1, keepdim=True), e)
        torch.testing.assert_close(dense, routed, atol=1e-4, rtol=1e-4)


def _sorted(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (expert, weight) pairs in expert order (top-k order is not part of a route)."""
    order = experts.argsort(dim=-1)
    return experts.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    ("experts", "groups", "kept", "top_k"), [(16, 4, 2, 4), (8, 1, 1, 2), (12, 3, 3, 6)]
)
def test_grouped_topk_routes_as_deepseek_v3(
    experts: int, groups: int, kept: int, top_k: int, renormalize: bool
) -> None:
    """Against transformers' DeepseekV3TopkRouter on random inputs and a random correction bias:
    the same experts for every token and the same weights (sigmoid scores, groups ranked by their
    two best biased scores, renormalized or not, times routed_scaling_factor)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from ember.models.layers.moe import grouped_topk

    cfg = DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=experts,
        n_group=groups,
        topk_group=kept,
        num_experts_per_tok=top_k,
        norm_topk_prob=renormalize,
        routed_scaling_factor=2.5,
    )
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(experts + top_k)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=g))
    x = torch.randn(64, 32, generator=g)
    logits, want_w, want_e = router(x)
    got_w, got_e = grouped_topk(
        logits, router.e_score_correction_bias, top_k, groups, kept, renormalize, 2.5
    )
    want_e, want_w = _sorted(want_w, want_e)
    got_e, got_w = _sorted(got_w, got_e)
    assert torch.equal(got_e, want_e)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)


def test_grouped_topk_keeps_to_the_best_groups_and_refuses_bad_shapes() -> None:
    """One group holds every high score but the bias lifts another: the route keeps to the groups
    ranked by biased scores; shapes that cannot hold the top k are refused by name."""
    from ember.models.layers.moe import grouped_topk

    logits = torch.tensor([[5.0, 4.0, -5.0, -5.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0, 2.0])  # group 2 (experts 4, 5) wins on bias
    w, e = grouped_topk(logits, bias, 2, 3, 1, renormalize=True, scaling=1.0)
    assert sorted(e[0].tolist()) == [4, 5]
    torch.testing.assert_close(w.sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="groups"):
        grouped_topk(logits, bias, 4, 3, 1, renormalize=True, scaling=1.0)
    with pytest.raises(ValueError, match="groups"):
        grouped_topk(logits, bias, 2, 4, 1, renormalize=True, scaling=1.0)


def test_shared_experts_load_as_extra_experts_and_run_both_ways() -> None:
    """A shared MLP of intermediate S * I loads as S experts after the routed ones; run as
    always-on experts of the routed path (weight 1) or alone through `shared`, it equals the MLP
    it was loaded from, and the routed experts are untouched by it."""
    from ember.models.layers.activation import silu_and_mul

    g = torch.Generator().manual_seed(1)
    experts, shared, hidden, inter = 6, 2, 12, 8
    m = FusedMoE(experts, 2, hidden, inter, renormalize=True, num_shared=shared)
    routed13 = torch.randn(experts, 2 * inter, hidden, generator=g)
    m.weight_loader(m.w13, routed13, "gate_up")
    m.weight_loader(m.w2, torch.randn(experts, hidden, inter, generator=g), "down")
    gate, up = (torch.randn(shared * inter, hidden, generator=g) for _ in range(2))
    down = torch.randn(hidden, shared * inter, generator=g)
    m.weight_loader(m.w13, gate, "shared.gate")
    m.weight_loader(m.w13, up, "shared.up")
    m.weight_loader(m.w2, down, "shared.down")
    assert torch.equal(m.w13[:experts], routed13)
    x = torch.randn(5, hidden, generator=g)
    mlp = silu_and_mul(torch.cat([x @ gate.T, x @ up.T], dim=-1)) @ down.T
    torch.testing.assert_close(m.shared(x), mlp, atol=1e-4, rtol=1e-4)
    ids = torch.arange(experts, experts + shared).expand(5, -1)
    torch.testing.assert_close(m.routed(x, torch.ones(5, shared), ids), mlp, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="shared experts' down_proj"):
        m.weight_loader(m.w2, down.T, "shared.down")
