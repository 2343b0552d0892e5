"""One row times a large weight matrix (y = x @ W.T for a single token): batch-1 decode's matmuls.

A decode step of one sequence reads every weight once for one row of activations: memory-bound,
and cuBLAS picks a kernel that leaves bandwidth unused at the larger shapes. H100, 8B shape,
inside CUDA graphs over weights larger than L2 (`benchmarks/gemv.py`), cuBLAS against this
kernel, us: gate/up 82.1 / 78.4, down 44.9 / 42.1, the LM head 372 / 337 (~0.24 ms of a 6.3 ms
step); but q/k/v 20.4 / 22.6 and o 16.6 / 18.5, so weights up to MIN_WEIGHT_ELEMENTS stay with
cuBLAS, as do two rows and more (this kernel's multiply-adds run on the CUDA cores).

Each program owns BLOCK_N output columns and walks the whole K: every weight row is read once,
in 1,024-element runs, with the row of x broadcast against it; fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.dispatch import use_triton

BLOCK_K = 1024
BLOCK_N = 4
MIN_WEIGHT_ELEMENTS = 1 << 25
"""Weights of at most this many elements (the 8B shape's q/k/v and o) go to cuBLAS (above)."""


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
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    n_ok = n < N
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
    tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for x of one row ([..., K] with one row in all), weight [N, K]."""
    n, k = weight.shape
    if x.shape[-1] != k or x.numel() != k:
        raise ValueError(f"x {tuple(x.shape)} must be one row of {k} for weight {(n, k)}")
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](
        x,
        weight,
        y,
        n,
        k,
        weight.stride(0),
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        EVEN_K=k % BLOCK_K == 0,
        num_warps=4,
        num_stages=3,
    )
    return y
