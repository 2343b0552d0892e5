"""Mixture-of-experts MLP (Qwen3-MoE routing): softmax router, top-k experts, optional renorm.

Expert weights are stacked, w13 = [E, 2I, H] (gate then up) and w2 = [E, H, I], the layout a fused
MoE kernel wants; the CPU path loops over the experts that received tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.models.layers.activation import gated_activation


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        act: str = "silu",
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = gated_activation(act)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        """shard: 'E.gate' | 'E.up' | 'E.down' for one expert, or 'gate_up' | 'down' for all."""
        i = self.intermediate_size
        with torch.no_grad():
            if shard in ("gate_up", "down"):
                param.data.copy_(loaded)
            else:
                expert, part = shard.split(".")
                e = int(expert)
                if part == "gate":
                    param.data[e, :i].copy_(loaded)
                elif part == "up":
                    param.data[e, i:].copy_(loaded)
                else:
                    param.data[e].copy_(loaded)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        if x.is_cuda:
            return self._dense(x, weights, experts)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            token_idx, slot = torch.where(experts == e)
            h = self.act(F.linear(x[token_idx], self.w13[e]))
            h = F.linear(h, self.w2[e]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, h)
        return out

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by the (mostly zero) routing weights.

        No host sync and no data-dependent shapes, so it can be captured in a CUDA graph; it
        costs num_experts / top_k times the routed FLOPs, fine for small expert counts. A fused
        MoE kernel (grouped GEMM over the routed tokens) is what large MoE models need.
        """
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        dense.scatter_(1, experts, weights)
        h = self.act(torch.einsum("th,eih->eti", x, self.w13))
        y = torch.einsum("eti,ehi->eth", h, self.w2)
        return torch.einsum("eth,te->th", y, dense)


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        act: str,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts, top_k, hidden_size, intermediate_size, renormalize, act
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))
