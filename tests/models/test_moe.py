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
