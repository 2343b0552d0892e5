"""MoE routing in one Triton launch: scores, (grouped) top-k, weights, renormalization, scaling.

References: `ember.models.layers.moe.softmax_topk` (Qwen3-MoE) and `grouped_topk` (DeepSeek-V3 /
Kimi K2). In torch a route is ~8 kernels (sigmoid or softmax, the bias add, the group mask, top-k,
gather, sum, divide, scale), each a few microseconds of GPU time for a few hundred values a token;
at decode that was ~0.4 ms of a 4.35 ms Moonlight step. One program per token does all of it on
its row of logits: the top k by k rounds of argmax (k <= 8; ties go to the lowest expert id).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _router_logits_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    num_experts,
    hidden,
    stride_x,
    stride_w,
    stride_o,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One token and BLOCK_E experts a program: their weight rows [BLOCK_E, H] times the token's
    # row, multiplied and summed on the CUDA cores in fp32 (tl.dot would pad the one token to 16
    # rows, and an fp32 "ieee" dot is emulated: 42 us a layer on an H200 at batch 1). BLOCK_H
    # spans the whole row where it fits: a loop of loads is not pipelined without a dot, and
    # four dependent 8 KB loads took 7 us.
    t = tl.program_id(0).to(tl.int64)
    es = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = es < num_experts
    acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < hidden
        x = tl.load(x_ptr + t * stride_x + hs, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + es[:, None] * stride_w + hs[None, :], mask=e_ok[:, None] & h_ok[None, :]
        )
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + t * stride_o + es, acc, mask=e_ok)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] (any float dtype) times the float32 router weight [E, H], in float32: what
    F.linear(x.float(), weight) computes, in one launch where that was three (the cast and
    cuBLAS's two-kernel fp32 GEMV, ~6 us a layer at decode on an H200). For decode-sized T: a
    program a (token, one or two experts), each reading its rows in one load, so one token
    spreads over E / 2 SMs or more; a batch's tokens re-read the weight from L2."""
    t, hidden = x.shape
    num_experts = weight.shape[0]
    if weight.shape[1] != hidden or weight.dtype != torch.float32:
        raise ValueError(
            f"router weight {tuple(weight.shape)} {weight.dtype}: want [E, {hidden}] fp32"
        )
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty(t, num_experts, dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    block_h = min(triton.next_power_of_2(hidden), 8192)
    block_e = 2 if block_h <= 4096 else 1
    _router_logits_kernel[(t, triton.cdiv(num_experts, block_e))](
        x,
        weight,
        out,
        num_experts,
        hidden,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_E=block_e,
        BLOCK_H=block_h,
        num_warps=4 if block_h <= 4096 else 8,
    )
    return out


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_t,
    scaling,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOP_K: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    es = tl.arange(0, BLOCK_E)
    real = es < num_experts
    x = tl.load(logits_ptr + t * stride_t + es, mask=real, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, 0))
        scores = p / tl.sum(p, 0)
    choose = scores
    if HAS_BIAS:
        choose = choose + tl.load(bias_ptr + es, mask=real, other=0.0).to(tl.float32)
    choose = tl.where(real, choose, float("-inf"))
    if TOPK_GROUPS < NUM_GROUPS:
        # A group ranks by the sum of its two best biased scores; keep the TOPK_GROUPS best.
        group = es // GROUP_SIZE
        gs = tl.arange(0, BLOCK_G)
        group_score = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            in_g = group == g
            vals = tl.where(in_g, choose, float("-inf"))
            first = tl.argmax(vals, 0)
            best = tl.max(vals, 0)
            second = tl.max(tl.where(es == first, float("-inf"), vals), 0)
            if GROUP_SIZE == 1:
                second = 0.0
            group_score = tl.where(gs == g, best + second, group_score)
        keep = tl.zeros((BLOCK_E,), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            g_best = tl.argmax(group_score, 0)
            keep = keep | (group == g_best)
            group_score = tl.where(gs == g_best, float("-inf"), group_score)
        choose = tl.where(keep, choose, float("-inf"))
    ks = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    picked_e = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        e = tl.argmax(choose, 0)
        w = tl.sum(tl.where(es == e, scores, 0.0), 0)
        picked_w = tl.where(ks == j, w, picked_w)
        picked_e = tl.where(ks == j, e, picked_e)
        choose = tl.where(es == e, float("-inf"), choose)
    if RENORMALIZE:
        total = tl.sum(picked_w, 0)
        if SIGMOID:
            total += 1e-20  # as grouped_topk; softmax weights are never all zero
        picked_w = picked_w / total
    picked_w = picked_w * scaling
    # Always-on (shared) experts follow the routed ones: ids num_experts.., weight 1.
    width = TOP_K + NUM_SHARED
    shared = ks >= TOP_K
    picked_w = tl.where(shared, 1.0, picked_w)
    picked_e = tl.where(shared, num_experts + ks - TOP_K, picked_e)
    out = t * width + ks
    tl.store(weights_ptr + out, picked_w, mask=ks < width)
    tl.store(ids_ptr + out, picked_e, mask=ks < width)


def route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    sigmoid: bool,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    scaling: float = 1.0,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k + S] float32, experts [T, k + S] int32) for router_logits [T, E]: softmax
    top-k (sigmoid False) or DeepSeek's sigmoid grouped top-k with its correction bias, then the
    S = num_shared always-on experts E .. E + S - 1 with weight 1 (shared experts run as experts
    of the fused MoE). Graph safe."""
    t, num_experts = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    width = top_k + num_shared
    weights = torch.empty(t, width, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, width, dtype=torch.int32, device=router_logits.device)
    if t == 0:
        return weights, ids
    _route_kernel[(t,)](
        router_logits,
        correction_bias if correction_bias is not None else router_logits,
        weights,
        ids,
        num_experts,
        router_logits.stride(0),
        float(scaling),
        SIGMOID=sigmoid,
        HAS_BIAS=correction_bias is not None,
        RENORMALIZE=renormalize,
        TOP_K=top_k,
        NUM_SHARED=num_shared,
        NUM_GROUPS=num_groups,
        TOPK_GROUPS=topk_groups if topk_groups < num_groups else num_groups,
        GROUP_SIZE=num_experts // num_groups,
        BLOCK_G=triton.next_power_of_2(num_groups),
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(width),
        num_warps=4 if num_experts > 128 else 1,
    )
    return weights, ids
