"""y = x @ W.T for a few rows of x (decode at small batch), as one Triton launch.

At batch 1 a linear layer is a matrix-vector product: it reads the whole weight once and does two
flops a weight, so only the weight's bytes matter. cuBLAS picks tile shapes for it that leave most
SMs idle on the 2048-wide layers of the MoE models (Moonlight's projections and shared experts ran
at ~45% of an H200's copy bandwidth at batch 1, docs/performance.md). Here every program owns a
narrow slice of output columns over the whole K, so even a 2048 x 2048 projection spreads over
128 programs, each streaming long rows of its weight slice. Reference: torch.nn.functional.linear.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.dispatch import dot_precision

MAX_ROWS = 16
"""Rows of x one launch takes (tl.dot's smallest tile); larger batches go to cuBLAS."""


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    m,
    n,
    k,
    x_sm,
    x_sk,
    w_sn,
    w_sk,
    y_sm,
    y_sn,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.arange(0, 16)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + cols[None, :].to(tl.int64) * w_sn
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < k
        x = tl.load(
            x_ptr + rows[:, None] * x_sm + ks[None, :] * x_sk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(w_base + ks[:, None] * w_sk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    tl.store(
        y_ptr + rows[:, None] * y_sm + cols[None, :] * y_sn,
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def tile_config(n: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): narrow column slices so that even N = 2048 makes 128 programs."""
    block_n = 16 if n <= 8192 else 32 if n <= 32768 else 64
    return block_n, 512 if block_n == 16 else 256


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] | None = None
) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] @ weight [N, K].T -> [M, N] in x's dtype; fp32 accumulation.
    config: (BLOCK_N, BLOCK_K, num_warps, num_stages), for benchmarks/skinny_gemm.py's sweep."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K], [N, K]"
        )
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {m}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_n, block_k, warps, stages = config or (*tile_config(n), 4, 3)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        y,
        m,
        n,
        k,
        *x.stride(),
        *weight.stride(),
        *y.stride(),
        PRECISION=dot_precision(x.dtype),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return y
