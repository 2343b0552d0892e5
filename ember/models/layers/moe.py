"""Mixture-of-experts MLP: routing (Qwen3-MoE's softmax top-k; DeepSeek-V3's sigmoid scores with a
correction bias and grouped top-k) and the experts.

Expert weights are stacked, w13 = [E, 2I, H] (gate then up) and w2 = [E, H, I], the layout a fused
MoE kernel (ember/kernels/fused_moe.py) wants; the CPU path, the reference, loops over the experts
that received tokens.

On a tensor-parallel engine (ember.distributed) the experts split one of two ways, and either way
the router and the routing run whole on every rank (the tokens are on every rank after attention)
and each rank's output is a partial sum that one all-reduce completes (the MoE block's):

- by width (tensor parallel, the default): every expert on every rank at I / size of its
  intermediate width (w13's gate and up rows [r I/size, (r+1) I/size), w2's same columns): the
  down projection's sum over the intermediate dim is split across the ranks.
- by expert (`expert_parallel`): E / size whole experts a rank, rank r the r-th run of ids. Each
  rank computes the pairs routed to its experts and skips the others (the kernels' `foreign`
  pairs), so the sum over a token's top k is split across the ranks. Every rank already holds
  every token, so no token is sent anywhere: one all-reduce of [T, H] combines the ranks, as it
  does for the dense layers. An all-to-all dispatch (each token to the ranks of its experts and
  back) moves T * k * H values in two collectives of data-dependent sizes (a host sync, or
  padding to the worst case, to know them); it pays when the tokens differ per rank (data-
  parallel attention) and the batches are large. At decode's batch sizes, with the tokens
  replicated, the one fixed-shape all-reduce is smaller in launches and latency, and graph safe.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed import comm, state
from ember.distributed.shard import shard_range, shard_size
from ember.kernels.dispatch import use_triton
from ember.models.layers.activation import gated_activation, silu_and_mul


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing: the top-k of the softmax over the experts, optionally renormalized to
    sum to 1; on a GPU one Triton launch. Returns (weights [T, k] float32, experts [T, k])."""
    if use_triton(router_logits):
        from ember.kernels.moe_routing import route

        return route(router_logits, top_k, sigmoid=False, renormalize=renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def grouped_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling: float,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Kimi K2 routing: sigmoid scores; the experts are chosen on score + bias
    (`e_score_correction_bias`, which balances load) within the `topk_groups` groups whose two
    best biased scores sum highest, and weighted by their unbiased scores (renormalized to sum
    to 1 if asked), times `scaling` (`routed_scaling_factor`). No host sync and fixed shapes:
    CUDA-graph safe; on a GPU one Triton launch (ember/kernels/moe_routing.py). The
    `num_shared` always-on experts E, E + 1, .. follow with weight 1. Returns
    (weights [T, k + num_shared] float32, experts [T, k + num_shared])."""
    t, e = router_logits.shape
    if e % num_groups or not 0 < topk_groups <= num_groups or top_k > topk_groups * e // num_groups:
        raise ValueError(
            f"grouped top-k: {e} experts in {num_groups} groups, {topk_groups} groups kept, "
            f"top {top_k}: the groups must divide the experts and hold the top k"
        )
    if use_triton(router_logits):
        from ember.kernels.moe_routing import route

        return route(
            router_logits,
            top_k,
            sigmoid=True,
            renormalize=renormalize,
            correction_bias=correction_bias,
            num_groups=num_groups,
            topk_groups=topk_groups,
            scaling=scaling,
            num_shared=num_shared,
        )
    scores = router_logits.float().sigmoid()
    biased = scores + correction_bias.float()
    if topk_groups < num_groups:  # else every group is kept (Moonlight: one group): no mask
        biased = _keep_best_groups(biased, num_groups, topk_groups)
    experts = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    if num_shared:
        shared = torch.arange(e, e + num_shared, device=experts.device).expand(t, -1)
        experts = torch.cat([experts, shared], dim=1)
        weights = torch.cat([weights, weights.new_ones(t, num_shared)], dim=1)
    return weights, experts


def _keep_best_groups(biased: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """The biased scores with every expert outside the `topk_groups` best groups (ranked by
    the sum of their two best biased scores) set to -inf."""
    t, e = biased.shape
    groups = biased.view(t, num_groups, e // num_groups)
    group_scores = groups.topk(min(2, e // num_groups), dim=-1).values.sum(dim=-1)
    kept = group_scores.topk(topk_groups, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return biased.masked_fill(~mask.repeat_interleave(e // num_groups, dim=1), float("-inf"))


class FusedMoE(nn.Module):
    """The experts of an MoE layer, stacked: `num_experts` routed ones, then `num_shared`
    always-on ones (DeepSeek's shared experts: a shared MLP of intermediate S * I is S experts of
    I, its hidden units split in S slices, since down(act(gate, up)) sums over them).

    On a tensor-parallel engine a rank holds its share (the module's docstring) and returns its
    partial sum, which the MoE block all-reduces: `local_experts` (the routed ids it holds) and
    `width` (its slice of the intermediate dim). Shared experts are stacked only when split by
    width; under expert parallel a model holds them apart (ember/models/deepseek_v3.py)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        act: str = "silu",
        num_shared: int = 0,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.num_shared = num_shared
        self.intermediate_size = intermediate_size
        """The checkpoint's (each expert's whole width); the rank holds `width` of it."""
        self.hidden_size = hidden_size
        self.act = gated_activation(act)
        self.local_experts, self.width = _split(num_experts, intermediate_size, num_shared)
        self.make_weights(len(self.local_experts) + num_shared, hidden_size, len(self.width))
        self.received: set[str] = set()
        """The shards `weight_loader` has filled, checked complete by `missing_shards`."""
        by_expert = len(self.local_experts) < num_experts
        experts_map = _expert_map(num_experts, self.local_experts) if by_expert else None
        # One count a local expert, and a last one for the pairs of other ranks' experts (so the
        # count needs no mask).
        counts = torch.zeros(len(self.local_experts) + 1, dtype=torch.int64) if by_expert else None
        self.expert_map: torch.Tensor | None
        self.pairs_routed: torch.Tensor | None
        self.register_buffer("expert_map", experts_map, persistent=False)
        self.register_buffer("pairs_routed", counts, persistent=False)

    @property
    def expert_load(self) -> torch.Tensor | None:
        """Under expert parallel: the (token, expert) pairs routed to each of this rank's experts
        since the model was built, cumulative int64 on the device ([len(local_experts)]), for
        the engine's metrics (read it off the step; forward never syncs on it). Rows a CUDA
        graph pads a batch with are routed and counted too. None otherwise: every rank holds
        every expert, and the one-device path counts nothing."""
        return None if self.pairs_routed is None else self.pairs_routed[:-1]

    def make_weights(self, total: int, hidden: int, inter: int) -> None:
        """The stacked experts' parameters (a quantized MoE holds other ones); `inter` is the
        rank's width."""
        self.w13 = nn.Parameter(torch.empty(total, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(total, hidden, inter))

    def local_index(self, expert: int) -> int | None:
        """Where routed expert `expert` sits in the stacked weights, None if another rank's."""
        return expert - self.local_experts.start if expert in self.local_experts else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        """shard: 'E.gate' | 'E.up' | 'E.down' for one expert, 'gate_up' | 'down' for all routed
        experts, 'shared.gate' | 'shared.up' | 'shared.down' for the shared MLP's weights
        ([S * I, H], [S * I, H], [H, S * I]). `loaded` is the checkpoint's whole tensor: the
        rank keeps its experts and its width of them (another rank's expert is passed over)."""
        i, e = self.intermediate_size, self.num_experts
        self.received.add(shard)
        with torch.no_grad():
            if shard.startswith("shared."):
                part = shard.split(".")[1]
                expected = (self.hidden_size, self.num_shared * i)
                if part != "down":
                    expected = expected[::-1]
                if tuple(loaded.shape) != expected:
                    raise ValueError(
                        f"shared experts' {part}_proj is {tuple(loaded.shape)}, expected {expected}"
                    )
                for s in range(self.num_shared):
                    rows = slice(s * i, (s + 1) * i)
                    piece = loaded[:, rows] if part == "down" else loaded[rows]
                    self._place(param, len(self.local_experts) + s, part, piece)
            elif shard in ("gate_up", "down"):
                ours = loaded[self.local_experts.start : self.local_experts.stop]
                for x in range(ours.shape[0]):
                    if shard == "down":
                        self._place(param, x, "down", ours[x])
                    else:
                        self._place(param, x, "gate", ours[x, :i])
                        self._place(param, x, "up", ours[x, i:])
            else:
                expert, part = shard.split(".")
                if int(expert) >= e:
                    raise ValueError(f"expert {expert} of a layer of {e} experts")
                x = self.local_index(int(expert))
                if x is not None:
                    self._place(param, x, part, loaded)

    def _place(self, param: nn.Parameter, x: int, part: str, full: torch.Tensor) -> None:
        """Copy the rank's width of one expert's checkpoint matrix `full` (its gate, up or down,
        whole) into stacked expert `x`."""
        a, b = self.width.start, self.width.stop
        if part == "gate":
            param.data[x, : b - a].copy_(full[a:b])
        elif part == "up":
            param.data[x, b - a :].copy_(full[a:b])
        else:
            param.data[x].copy_(full[:, a:b])

    def missing_shards(self, attr: str) -> list[str]:
        """The shards of `attr` ("w13": gate and up, "w2": down) no checkpoint tensor has filled:
        each of the rank's routed experts' (or all of them at once, a checkpoint's stacked
        experts) and the shared experts'."""
        parts = ("gate", "up") if attr == "w13" else ("down",)
        stacked = "gate_up" if attr == "w13" else "down"
        missing = []
        if stacked not in self.received:
            missing += [
                f"{x}.{p}"
                for x in self.local_experts
                for p in parts
                if f"{x}.{p}" not in self.received
            ]
        if self.num_shared:
            missing += [f"shared.{p}" for p in parts if f"shared.{p}" not in self.received]
        return missing

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, experts = softmax_topk(router_logits, self.top_k, self.renormalize)
        return self.routed(x, weights, experts)

    def to_local(self, experts: torch.Tensor) -> torch.Tensor:
        """Under expert parallel: routed ids [T, k] as this rank's stacked indices, those of
        other ranks' experts as len(local_experts) (the kernels' `foreign` pairs), each pair
        counted into `pairs_routed`. Two gathers and an add on the device, no host sync."""
        assert self.expert_map is not None and self.pairs_routed is not None
        flat = self.expert_map.index_select(0, experts.reshape(-1))
        self.pairs_routed.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
        return flat.view(experts.shape)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The experts' output for tokens already routed: sum over k of weights[t, k] times
        expert experts[t, k] on x[t] (under expert parallel, over this rank's experts only). On
        a GPU the fused Triton grouped GEMM, else (Triton off) the dense graph-safe path; on the
        CPU the per-expert loop, the reference."""
        foreign = self.expert_map is not None
        if foreign:
            experts = self.to_local(experts)
        if use_triton(x):
            from ember.kernels.fused_moe import fused_moe

            return fused_moe(x, self.w13, self.w2, weights, experts, foreign=foreign)
        if x.is_cuda:
            return self._dense(x, weights, experts, foreign)
        return routed_experts_ref(x, self.w13, self.w2, weights, experts, self.act)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts alone, as one MLP through cuBLAS on views of the stacked weights
        (for prefill-sized batches, where cuBLAS outruns the grouped GEMM)."""
        e, s, i = len(self.local_experts), self.num_shared, len(self.width)
        gate_up = F.linear(x, self.w13[e:].reshape(s * 2 * i, -1))  # [T, S * 2I]
        h = self.act(gate_up.view(x.shape[0], s, 2 * i))  # [T, S, I]
        out = F.linear(h[:, 0], self.w2[e])
        for j in range(1, s):
            out.addmm_(h[:, j], self.w2[e + j].t())
        return out

    def _dense(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, foreign: bool = False
    ) -> torch.Tensor:
        """Every expert on every token, weighted by the (mostly zero) routing weights.

        No host sync and no data-dependent shapes, so it can be captured in a CUDA graph; it
        costs num_experts / top_k times the routed FLOPs: the fallback when Triton is off.
        `foreign` pairs land in a column past the experts, dropped.
        """
        n = self.w13.shape[0]
        dense = torch.zeros(x.shape[0], n + foreign, dtype=x.dtype, device=x.device)
        dense.scatter_(1, experts, weights.to(x.dtype))
        h = self.act(torch.einsum("th,eih->eti", x, self.w13))
        y = torch.einsum("eti,ehi->eth", h, self.w2)
        return torch.einsum("eth,te->th", y, dense[:, :n])


def _split(num_experts: int, intermediate_size: int, num_shared: int) -> tuple[range, range]:
    """(routed experts, intermediate columns) this rank holds, by the parallel state."""
    s = state.current()
    experts, width = range(num_experts), range(intermediate_size)
    if not s.is_parallel:
        return experts, width
    if not s.expert_parallel:
        return experts, range(
            *shard_range(intermediate_size, s.rank, s.size, "moe_intermediate_size")
        )
    if num_shared:
        raise ValueError(
            "expert parallel holds shared experts apart from the routed ones (split by width)"
        )
    if num_experts % s.size:
        raise ValueError(
            f"expert parallel: {num_experts} routed experts do not split into whole experts over "
            f"{s.size} ranks; use a size that divides {num_experts}, or tensor-parallel experts "
            "(each split by width: leave enable_expert_parallel off)"
        )
    n = shard_size(num_experts, s.size, "num_experts")
    return range(s.rank * n, (s.rank + 1) * n), width


def _expert_map(num_experts: int, local: range) -> torch.Tensor:
    """Routed id -> this rank's stacked index, len(local) for another rank's expert: int64, the
    index type of the gathers and the count."""
    m = torch.full((num_experts,), len(local), dtype=torch.int64)
    m[local.start : local.stop] = torch.arange(len(local))
    return m


def routed_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """The reference MoE: a loop over the experts that received tokens (host syncs, so eager
    only). x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights and experts [T, k]; an id of E or
    more names another rank's expert and adds nothing."""
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        if e >= w13.shape[0]:  # another rank's expert (expert parallel): not this rank's sum
            continue
        token_idx, slot = torch.where(experts == e)
        h = act(F.linear(x[token_idx], w13[e]))
        h = F.linear(h, w2[e]) * weights[token_idx, slot, None]
        out.index_add_(0, token_idx, h)
    return out


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        act: str,
        experts: FusedMoE | None = None,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = experts or FusedMoE(
            num_experts, top_k, hidden_size, intermediate_size, renormalize, act
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """On a tensor-parallel engine each rank's experts give a partial sum: one all-reduce."""
        return comm.all_reduce(self.experts(x, self.gate(x)))
