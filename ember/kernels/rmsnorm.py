"""RMSNorm as one Triton pass per row, with the residual add fused in.

Reference: `ember.models.layers.norm.RMSNorm`. Its rounding points are kept: x + residual is rounded
to the activation dtype before it is normalized, and the normalized row is rounded to that dtype
before the weight multiplies it, so bf16 results match the reference to the last bit or so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The whole row stays in registers (one read of each input); past this, a row would need 64+ fp32
# values per thread even at 32 warps and would spill.
MAX_HIDDEN = 32768


# Sizes that change from batch to batch (and pointers into sliced tensors) do not specialize:
# one compiled variant serves every batch, so none is compiled on the request path.
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    sum_ptr,
    w_ptr,
    out_ptr,
    n_rows,
    n_inner,
    hidden,
    eps,
    x_s0,
    x_s1,
    x_sn,
    r_s0,
    r_s1,
    r_sn,
    s_s0,
    s_s1,
    s_sn,
    o_s0,
    o_s1,
    o_sn,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # int64 row numbers: T * stride can pass 2**31 on long prefills with wide rows.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    # A row is (i0, i1) of a [T, heads, D] tensor; 2-D inputs come with n_inner == 1, which Triton
    # specializes, so the division folds away.
    i0 = rows // n_inner
    i1 = rows % n_inner
    x = tl.load(
        x_ptr + (i0 * x_s0 + i1 * x_s1)[:, None] + cols[None, :] * x_sn, mask=mask, other=0.0
    )
    if HAS_RESIDUAL:
        r = tl.load(
            res_ptr + (i0 * r_s0 + i1 * r_s1)[:, None] + cols[None, :] * r_sn, mask=mask, other=0.0
        )
        # Rounded to the activation dtype first: the reference normalizes the rounded sum.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + (i0 * s_s0 + i1 * s_s1)[:, None] + cols[None, :] * s_sn, x, mask=mask)
    xf = x.to(tl.float32)
    # Masked lanes hold 0, so they add nothing to the sum of squares.
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / hidden + eps)
    normed = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)[None, :]
    tl.store(
        out_ptr + (i0 * o_s0 + i1 * o_s1)[:, None] + cols[None, :] * o_sn,
        y.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(stride of dim 0, stride of the heads dim or 0, stride along the row)."""
    if t.dim() == 2:
        return t.stride(0), 0, t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _check_like(name: str, t: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> None:
    if t.shape != x.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(x.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device}, x is on {x.device}")


def launch_config(hidden: int, n_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M rows per program, BLOCK_N columns, num_warps) for rows of `hidden` elements."""
    block_n = triton.next_power_of_2(hidden)
    # Short rows (per-head q/k norm, head_dim 128) share a program, ~1K elements each, so the grid
    # is not T * heads tiny programs.
    block_m = min(max(1, 1024 // block_n), triton.next_power_of_2(max(n_rows, 1)))
    # About 16 elements per thread: two 16-byte loads of bf16 per input, few registers, and the
    # 32-warp cap keeps 32768-wide rows at 32 fp32 values per thread.
    num_warps = min(32, max(4, block_m * block_n // 512))
    return block_m, block_n, num_warps


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    inplace: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [T, H] or [T, heads, D]; fp32 math.

    Without `residual`, returns weight * norm(x). With it, returns (weight * norm(s), s) for
    s = x + residual; `inplace=True` writes s into `residual` instead of a new tensor. `out` may
    be x itself. The output dtype is torch.promote_types(x.dtype, weight.dtype), as in the reference.
    """
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [T, H] or [T, heads, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    hidden = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise ValueError(f"weight must be [{hidden}], got shape {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x is on {x.device}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"rows of {hidden} elements exceed the single-pass limit {MAX_HIDDEN}")
    if inplace and residual is None:
        raise ValueError("inplace=True writes x + residual into residual, but residual is None")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if residual is not None:
        _check_like("residual", residual, x, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    else:
        _check_like("out", out, x, out_dtype)
    if residual is None:
        res_sum = None
    elif inplace:
        res_sum = residual
    else:
        res_sum = torch.empty_like(x, memory_format=torch.contiguous_format)

    n_inner = 1 if x.dim() == 2 else x.shape[1]
    n_rows = x.shape[0] * n_inner
    if n_rows > 0 and hidden > 0:
        block_m, block_n, num_warps = launch_config(hidden, n_rows)
        # Unused pointers/strides when there is no residual: x's stand in, never touched.
        r = residual if residual is not None else x
        s = res_sum if res_sum is not None else x
        _rms_norm_kernel[(triton.cdiv(n_rows, block_m),)](
            x,
            r,
            s,
            weight,
            out,
            n_rows,
            n_inner,
            hidden,
            eps,
            *_row_strides(x),
            *_row_strides(r),
            *_row_strides(s),
            *_row_strides(out),
            HAS_RESIDUAL=residual is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    if res_sum is None:
        return out
    return out, res_sum
