"""One row times a large weight matrix (y = x @ W.T for a single token): batch-1 decode's matmuls.

A decode step of one sequence reads every weight once for one row of activations: memory-bound,
and cuBLAS picks kernels that leave bandwidth unused. H100, 8B shape, inside CUDA graphs over
weights larger than L2 (`benchmarks/probes/gemv.py`), cuBLAS against this kernel, us: q/k/v
20.3 / 18.7, o 15.5 / 13.5 (cuBLAS also adds a split-K reduce kernel), gate/up 81.4 / 77.9, down
43.5 / 41.3, the LM head 374 / 336; served batch-1 TPOT 5.92 ms against 6.09 with q/k/v and o
still on cuBLAS (same call). Weights up to MIN_WEIGHT_ELEMENTS (a tiny model's) stay with cuBLAS,
as do two rows and more (this kernel's multiply-adds run on the CUDA cores).

Each program owns BLOCK_N output columns and walks the whole K: every weight row is read once,
in 1,024-element runs, with the row of x broadcast against it; fp32 accumulation.

`gemv_silu` is the MLP's gate/up projection with SiLU-and-mul in its epilogue: each program takes
BLOCK_N / 2 gate rows and the matching up rows (interleaved, so the tile and its sums are the
plain GEMV's), rounds both to the activation dtype as the GEMV's store would, and writes
silu(gate) * up with the rounding of ember/kernels/activation.py: the bits of the GEMV followed by
that kernel, one launch fewer. Measured level with the two kernels, not faster (H100: served
batch-1 6.09 / 6.09 ms, 32 layers' chain 5.155 / 5.140 ms; why the saved launch does
not show was not found). Folding the activation into the down projection's read of x instead
was slower: every program recomputed the whole row's activation (docs/performance.md).

`gemv_qkv_rope` is attention's q/k/v projection with the rotation and the KV-cache write in its
epilogue: each program takes two rotation pairs of one head (columns c, c + 1 and their partners
a half-head on), rounds its sums as the GEMV's store would, rotates the q and k heads with
ember/kernels/rotary.py's fp32 math and writes k and v into the token's cache slot: the bits of
the GEMV followed by `apply_rotary(..., kv_cache=...)`, one launch a layer fewer. Served batch-1
TPOT on an H200 4.43 / 4.43 ms against 4.50 / 4.49 without it (runs alternated).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.dispatch import use_triton

BLOCK_K = 1024
BLOCK_N = 4
MIN_WEIGHT_ELEMENTS = 1 << 22
"""Weights of at most this many elements go to cuBLAS: every matmul of the 8B shape (o, the
smallest, has 16.8M) takes the GEMV; a threshold of 32M (gate/up, down and the LM head only) was
0.17 ms a step slower served (H100)."""


def usable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether y = F.linear(x, weight, bias) is one row that this kernel takes: a weight of more
    than MIN_WEIGHT_ELEMENTS, where the Triton kernels run (ember.kernels.dispatch), no bias,
    one dtype, contiguous rows."""
    return (
        bias is None
        and x.numel() == x.shape[-1]
        and weight.numel() > MIN_WEIGHT_ELEMENTS
        and x.dtype == weight.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
        and x.stride(-1) == 1
        and use_triton(x)
    )


@triton.jit
def _row_dots(
    x_ptr,
    w_ptr,
    n,
    n_ok,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """fp32 dot products of the row x with weight rows n (masked by n_ok), 1,024-element runs."""
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(rows + k[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + k)
        else:
            w = tl.load(rows + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0.0)
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    return acc


@triton.jit(do_not_specialize=["N", "K"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SILU_PAIRS: tl.constexpr,
):
    if SILU_PAIRS:
        # N is the activation's width: tile row 2i is gate row c + i, row 2i + 1 up row N + c + i.
        r = tl.arange(0, BLOCK_N)
        col = tl.program_id(0) * (BLOCK_N // 2) + r // 2
        n = col + (r % 2) * N
        n_ok = col < N
    else:
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
    acc = _row_dots(x_ptr, w_ptr, n, n_ok, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K)
    if SILU_PAIRS:
        gate, up = tl.split(tl.reshape(acc.to(y_ptr.dtype.element_ty), (BLOCK_N // 2, 2)))
        gate = gate.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty)
        y = act.to(tl.float32) * up.to(tl.float32)
        c = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + c, y.to(y_ptr.dtype.element_ty), mask=c < N)
    else:
        tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["K"])
def _gemv_rope_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    slot_ptr,
    K,
    stride_wn,
    cos_sp,
    sin_sp,
    c_sb,
    c_skv,
    c_st,
    c_sh,
    N_Q_HEADS: tl.constexpr,
    N_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # A program's four rows are two rotation pairs of one head, (c, c + HALF) and (c + 1,
    # c + 1 + HALF): tile row 2 * half + e is column c + e of that half.
    HALF: tl.constexpr = HEAD_DIM // 2
    head = tl.program_id(0) // (HALF // 2)
    c = (tl.program_id(0) % (HALF // 2)) * 2
    r = tl.arange(0, 4)
    col = c + (r % 2) + (r // 2) * HALF
    n = head * HEAD_DIM + col
    acc = _row_dots(x_ptr, w_ptr, n, n >= 0, K, stride_wn, 4, BLOCK_K, EVEN_K)
    out = acc.to(y_ptr.dtype.element_ty)  # the GEMV's own rounding, as its store would
    if head < N_Q_HEADS + N_KV_HEADS:
        # q and k: ember/kernels/rotary.py's rotation of the rounded values, its fp32 math.
        pos = tl.load(pos_ptr).to(tl.int64)
        e = tl.arange(0, 2)
        cos1 = tl.load(cos_ptr + pos * cos_sp + c + e).to(tl.float32)
        cos2 = tl.load(cos_ptr + pos * cos_sp + c + HALF + e).to(tl.float32)
        sin1 = tl.load(sin_ptr + pos * sin_sp + c + e).to(tl.float32)
        sin2 = tl.load(sin_ptr + pos * sin_sp + c + HALF + e).to(tl.float32)
        x1, x2 = tl.split(tl.trans(tl.reshape(out.to(tl.float32), (2, 2))))
        o1 = x1 * cos1 - x2 * sin1
        o2 = x2 * cos2 + x1 * sin2
        out = tl.reshape(tl.trans(tl.join(o1, o2)), (4,)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + n, out)
    if head >= N_Q_HEADS:
        # k and v: into the token's paged slot too ([blocks, 2, page, heads, D]); slot -1 marks
        # a padding row, written nowhere.
        slot = tl.load(slot_ptr).to(tl.int64)
        kv = head - N_Q_HEADS
        dst = (
            cache_ptr
            + (slot // PAGE) * c_sb
            + (kv // N_KV_HEADS) * c_skv
            + (slot % PAGE) * c_st
            + (kv % N_KV_HEADS) * c_sh
            + col
        )
        tl.store(dst, out.to(cache_ptr.dtype.element_ty), mask=(r >= 0) & (slot >= 0))


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for x of one row ([..., K] with one row in all), weight [N, K]."""
    return _launch(x, weight, weight.shape[0], silu_pairs=False)


def gemv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(F.linear(x, weight)) for x of one row and weight [2I, K] (gate rows, then
    up rows): [..., I], the same bits as the two kernels one after the other."""
    if weight.shape[0] % 2:
        raise ValueError(f"weight {tuple(weight.shape)} must be [2I, K]: gate rows, then up rows")
    return _launch(x, weight, weight.shape[0] // 2, silu_pairs=True)


def rope_usable(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_q_heads: int,
    num_kv_heads: int,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
) -> bool:
    """Whether `gemv_qkv_rope` takes this q/k/v projection: a row the GEMV takes (`usable`: no
    bias among others), a [q | k | v] weight of whole heads whose halves split into pairs, a
    rotation over the whole head (contiguous cos and sin tables [P, head_dim]), and a cache of
    x's dtype, contiguous in head_dim."""
    heads = num_q_heads + 2 * num_kv_heads
    head_dim = weight.shape[0] // heads if heads else 0
    return (
        usable(x, weight, bias)
        and head_dim * heads == weight.shape[0]
        and head_dim % 4 == 0
        and cos_cache.dim() == 2
        and cos_cache.shape[1] == head_dim
        and sin_cache.shape == cos_cache.shape
        and cos_cache.is_contiguous()
        and sin_cache.is_contiguous()
        and kv_cache.dim() == 5
        and kv_cache.shape[3:] == (num_kv_heads, head_dim)
        and kv_cache.dtype == x.dtype
        and kv_cache.stride(4) == 1
    )


def gemv_qkv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """The q/k/v projection of one token with the rotation and the KV write in its epilogue:
    F.linear(x, weight) ([..., (Hq + 2 Hkv) * D]) with the q and k heads rotated by the token's
    position as ember/kernels/rotary.py rotates them (NeoX halves, fp32 math on the GEMV's
    rounded values), and k and v written into the token's slot of one layer's kv_cache
    ([blocks, 2, page, Hkv, D]; slot -1 writes nothing): the bits of the GEMV followed by
    `apply_rotary(..., kv_cache=...)`, one launch fewer. `rope_usable` says when it applies."""
    n, k = _one_row(x, weight)
    if positions.numel() != 1 or slot_mapping.numel() != 1:
        raise ValueError("one token: one position and one slot")
    head_dim = n // (num_q_heads + 2 * num_kv_heads)
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _gemv_rope_kernel[(n // 4,)](
        x, weight, y, positions, cos_cache, sin_cache, kv_cache, slot_mapping,
        k, weight.stride(0), cos_cache.stride(0), sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        N_Q_HEADS=num_q_heads,
        N_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE=kv_cache.shape[2],
        BLOCK_K=BLOCK_K,
        EVEN_K=k % BLOCK_K == 0,
        num_warps=4,
        num_stages=3,
    )  # fmt: skip
    return y


def _one_row(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    """weight's (N, K), once x is checked to be one row of K."""
    n, k = weight.shape
    if x.shape[-1] != k or x.numel() != k:
        raise ValueError(f"x {tuple(x.shape)} must be one row of {k} for weight {(n, k)}")
    return n, k


def _launch(x: torch.Tensor, weight: torch.Tensor, width: int, *, silu_pairs: bool) -> torch.Tensor:
    n, k = _one_row(x, weight)
    y = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    # With SILU_PAIRS a program's BLOCK_N rows are BLOCK_N / 2 outputs' gate and up rows.
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](
        x,
        weight,
        y,
        width,
        k,
        weight.stride(0),
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        EVEN_K=k % BLOCK_K == 0,
        SILU_PAIRS=silu_pairs,
        num_warps=4,
        num_stages=3,
    )
    return y
