"""Fused mixture-of-experts (Triton): a grouped GEMM over the (token, expert) pairs sorted by expert.

`align_by_expert` lays the T * k routed pairs out expert by expert, each expert's run padded to a
whole number of BLOCK_M rows, and names each block's expert. The grouped GEMM then runs one
program per (block, column tile): it reads its expert's weight tile and multiplies it by the
block's rows, gathered from the tokens in place, so no permuted copy of the activations is made.
Two launches make an expert MLP:

1. gate/up: h[p] = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T) for pair p = (t, e). The
   program keeps a gate and an up accumulator for the same columns and writes only h [T * k, I]:
   the SiLU-and-mul is fused into the epilogue, saving a write and read of [T * k, 2I].
2. down: y[p] = weight[p] * (h[p] @ w2[e].T), the routing weight applied in the epilogue, written
   k-major ([k, T, H]); the k slabs are then summed (deterministic, unlike atomic adds).

Everything, routing included (ember/kernels/moe_routing.py), is fixed-shape kernels with no host
sync, so the whole MoE layer is captured in CUDA graphs. The reference is FusedMoE's per-expert loop
(ember/models/layers/moe.py).

The two numbers, per layer and step: bytes ~= (experts hit) * 3 * H * I * itemsize of weights plus
the activations; flops = 6 * T * k * H * I. At decode batch 1 only k experts are read (memory
bound); at batch 256 of a 128-expert model every expert is hit by ~16 rows, still under the ~300
flops per byte where an H100 turns compute bound, so the weights' bytes set the floor there too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.dispatch import dot_precision

UNSORTED_MAX_TOKENS = 2
"""Up to this many tokens the pairs are not sorted: each pair is its own block of the grouped GEMM
(its expert read from the routing), which saves the alignment's five launches (~6 us of a
Moonlight layer's ~130 at batch 1 on an H200). A token's k experts are distinct, so at batch 1
every weight is read once either way; at two tokens an expert both chose is read twice (from L2
when the two blocks run together). Past that, sorting pays: the rows of an expert share its tiles."""


# Sizes that change from batch to batch (and pointers into sliced tensors) do not specialize:
# one compiled variant serves every batch, so none is compiled on the request path.
@triton.jit(do_not_specialize=["n"])
def _count_kernel(experts_ptr, counts_ptr, rank_ptr, n, BLOCK: tl.constexpr):
    # Each pair's rank among its expert's pairs is the count before it: the atomic's old value.
    # The order within an expert is arbitrary but harmless: every row of the GEMM is computed
    # on its own, so a pair's output does not depend on where in its expert's run it sits.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    e = tl.load(experts_ptr + offs, mask=ok, other=0)
    rank = tl.atomic_add(counts_ptr + e, 1, mask=ok, sem="relaxed")
    tl.store(rank_ptr + offs, rank, mask=ok)


@triton.jit(do_not_specialize=["max_blocks"])
def _runs_kernel(
    counts_ptr,
    run_start_ptr,
    block_experts_ptr,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # One program: each expert's run padded to whole blocks, the runs' starts, each block's expert.
    es = tl.arange(0, BLOCK_E)
    real = es < num_experts
    counts = tl.load(counts_ptr + es, mask=real, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(run_start_ptr + es, ends - padded, mask=real)
    for b0 in range(0, max_blocks, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B)
        # A block's expert is the number of runs that end at or before its first row; past the
        # last run that is num_experts, which the GEMM skips.
        done = (ends[None, :] <= (bs * BLOCK_M)[:, None]) & real[None, :]
        tl.store(block_experts_ptr + bs, tl.sum(done.to(tl.int32), axis=1), mask=bs < max_blocks)


@triton.jit(do_not_specialize=["n"])
def _place_kernel(experts_ptr, rank_ptr, run_start_ptr, pairs_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    e = tl.load(experts_ptr + offs, mask=ok, other=0)
    rank = tl.load(rank_ptr + offs, mask=ok, other=0)
    dest = tl.load(run_start_ptr + e, mask=ok, other=0) + rank
    tl.store(pairs_ptr + dest, offs, mask=ok)


def align_by_expert(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the routed pairs by expert, each expert's run padded to a multiple of block_m.

    experts: [T, k] expert ids. Returns (sorted_pairs, block_experts): sorted_pairs [P] holds flat
    pair indices t * k + j (padding holds T * k, which the kernel masks), block_experts [P / block_m]
    the expert of each block, num_experts for blocks past the last expert's run (skipped).
    P = min(T * k, blocks) * block_m is a function of the shapes only, so the result is graph safe:
    every non-empty expert takes at least one block, so at most T * k blocks are used.
    Three small Triton launches (count, runs, place) after two fills: the torch-op version of the
    same (bincount by scatter, stable argsort, cumsums, searchsorted) took ~15 launches and
    38-138 us of GPU time on an H200, a fifth of a batch-256 MoE layer.
    """
    flat = experts.reshape(-1).to(torch.int32)
    n = flat.numel()
    device = flat.device
    max_blocks = min(n, triton.cdiv(n + num_experts * (block_m - 1), block_m))
    sorted_pairs = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    if n == 0:
        return sorted_pairs, block_experts
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(n, dtype=torch.int32, device=device)
    run_start = torch.empty(num_experts, dtype=torch.int32, device=device)
    block = 1024
    _count_kernel[(triton.cdiv(n, block),)](flat, counts, rank, n, BLOCK=block)
    block_e = triton.next_power_of_2(num_experts)
    _runs_kernel[(1,)](
        counts,
        run_start,
        block_experts,
        num_experts,
        max_blocks,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        BLOCK_B=max(16, 8192 // block_e),
    )
    _place_kernel[(triton.cdiv(n, block),)](flat, rank, run_start, sorted_pairs, n, BLOCK=block)
    return sorted_pairs, block_experts


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weight_ptr,
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    n_out,
    k_in,
    a_sm,
    a_sk,
    b_se,
    b_sn,
    b_sk,
    c_sm,
    c_sn,
    num_blocks,
    ROWS_PER_A: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    K_MAJOR_OUT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped launch order: GROUP_M row blocks (usually one expert's) sweep the column tiles
    # together, so an expert's weight tile is fetched from HBM once and served from L2 after.
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(n_out, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    if PAIR_BLOCKS:
        # Unsorted: block b is pair b alone (row 0; tl.dot wants 16 rows, the rest are masked),
        # its expert read from the routing itself.
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
    else:
        pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    a_rows = (pairs // ROWS_PER_A).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    offs_k = tl.arange(0, BLOCK_K)

    a_base = a_ptr + a_rows[:, None] * a_sm
    b_base = b_ptr + expert.to(tl.int64) * b_se + cols[None, :].to(tl.int64) * b_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < k_in
        a = tl.load(a_base + ks[None, :] * a_sk, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        b = tl.load(b_base + ks[:, None] * b_sk, mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            b_up = tl.load(b_base + n_out * b_sn + ks[:, None] * b_sk, mask=b_mask, other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)

    if GATED:
        # As silu_and_mul: each projection rounded to the activations' dtype, silu(gate) rounded
        # again before the multiply, so bf16 results match the unfused reference.
        gate = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(c_ptr.dtype.element_ty)
        acc = act.to(tl.float32) * up
    if MUL_WEIGHT:
        acc = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        # The routing weight rounded to the activations' dtype first, as the reference multiplies.
        w = tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(c_ptr.dtype.element_ty)
        acc = acc * w.to(tl.float32)[:, None]
    if K_MAJOR_OUT:  # pair t * k + j to row j * T + t: the top-k sum then adds k whole slabs
        out_rows = (pairs % K_MAJOR_OUT) * (num_pairs // K_MAJOR_OUT) + pairs // K_MAJOR_OUT
    else:
        out_rows = pairs
    c = c_ptr + out_rows[:, None].to(tl.int64) * c_sm + cols[None, :] * c_sn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _sum_slabs_kernel(y_ptr, out_ptr, n, NUM_SLABS: tl.constexpr, BLOCK: tl.constexpr):
    # out[i] = sum_j y[j * n + i], in fp32 and rounded once, as torch.sum over the first dim.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # k * T * H may pass 2**31
    ok = offs < n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(NUM_SLABS):
        acc += tl.load(y_ptr + j * n + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_slabs(y: torch.Tensor) -> torch.Tensor:
    """y [k, T, H] contiguous summed over k: one launch of ~1 us where torch's reduction over the
    first dim took ~5 us at decode sizes on an H200 (its generic reduce kernel), every layer."""
    k, t, hidden = y.shape
    out = torch.empty(t, hidden, dtype=y.dtype, device=y.device)
    n = t * hidden
    if n:
        block = 1024
        _sum_slabs_kernel[(triton.cdiv(n, block),)](y, out, n, NUM_SLABS=k, BLOCK=block)
    return out


def tile_config(num_pairs: int, num_experts: int) -> dict[str, int]:
    """Tile sizes by rows per expert, the fastest of benchmarks/probes/moe_kernel.py's sweep on an H200
    at the Moonlight and Qwen3-30B expert dims: decode-sized batches (a few rows an expert) are
    bound by the weights' bytes, so small row blocks and long K tiles keep many loads in flight;
    prefill-sized ones are bound by the tensor cores and take 128 x 128 tiles over 8 warps."""
    per_expert = num_pairs / num_experts
    if per_expert < 12:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    if per_expert <= 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def _gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    weights: torch.Tensor | None,
    sorted_pairs: torch.Tensor | None,
    block_experts: torch.Tensor,
    rows_per_a: int,
    gated: bool,
    config: dict[str, int],
    k_major_out: int = 0,
) -> None:
    n_out = c.shape[1]
    num_blocks = block_experts.numel()
    tiles_n = triton.cdiv(n_out, config["BLOCK_N"])
    _moe_gemm_kernel[(num_blocks * tiles_n,)](
        a,
        b,
        c,
        weights if weights is not None else c,
        sorted_pairs if sorted_pairs is not None else block_experts,
        block_experts,
        c.shape[0],
        b.shape[0],
        n_out,
        a.shape[1],
        *a.stride(),
        *b.stride(),
        *c.stride(),
        num_blocks,
        ROWS_PER_A=rows_per_a,
        PAIR_BLOCKS=sorted_pairs is None,
        GATED=gated,
        MUL_WEIGHT=weights is not None,
        K_MAJOR_OUT=k_major_out,
        PRECISION=dot_precision(a.dtype),
        GROUP_M=8,
        **config,
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * w2[e] @ silu_and_mul(w13[e] @ x[t]) with e = experts[t, j].

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; weights [T, k] (any float
    dtype, applied in x's dtype's precision); experts [T, k] ints in [0, E). Returns [T, H].
    """
    t, hidden = x.shape
    num_experts, two_i, w13_hidden = w13.shape
    inter = two_i // 2
    if w13_hidden != hidden or two_i % 2 or w2.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
            "do not fit [T, H], [E, 2I, H], [E, H, I]"
        )
    if weights.shape != experts.shape or experts.dim() != 2 or experts.shape[0] != t:
        raise ValueError(
            f"fused_moe: weights {tuple(weights.shape)} and experts {tuple(experts.shape)} "
            f"must both be [{t}, k]"
        )
    top_k = experts.shape[1]
    if t == 0 or top_k == 0:
        return torch.zeros_like(x)
    num_pairs = t * top_k
    config = config or tile_config(num_pairs, num_experts)
    sorted_pairs: torch.Tensor | None
    if t <= UNSORTED_MAX_TOKENS:
        sorted_pairs, block_experts = None, experts.reshape(-1).to(torch.int32)
        config = {**config, "BLOCK_M": 16}
    else:
        sorted_pairs, block_experts = align_by_expert(experts, num_experts, config["BLOCK_M"])
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gemm(x, w13, h, None, sorted_pairs, block_experts, top_k, True, config)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    # y comes out [k, T, H]: summing k contiguous slabs is a vectorized add, where the sum over
    # the middle dim of [T, k, H] took 5.5 of Moonlight's 180 ms of an 8 x 2048 prefill.
    _gemm(h, w2, y, weights.reshape(-1), sorted_pairs, block_experts, 1, False, config, top_k)
    return sum_slabs(y.view(top_k, t, hidden))
