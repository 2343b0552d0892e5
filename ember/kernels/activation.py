"""SiLU-and-mul for the gated MLP, fused into one Triton pass: silu(gate) * up.

Reference: `ember.models.layers.activation.silu_and_mul`. Math is in fp32; like the reference (and
Hugging Face), silu(gate) is rounded to the input dtype before the multiply, so bf16 results match.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,
    x_st,
    x_sd,
    o_st,
    o_sd,
    BLOCK: tl.constexpr,
):
    # Rows on grid axis 0 (up to 2**31 - 1); axis 1 is capped at 65535 blocks of columns.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + t * x_st
    gate = tl.load(row + cols * x_sd, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + (cols + inter) * x_sd, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    y = act.to(tl.float32) * up
    tl.store(out_ptr + t * o_st + cols * o_sd, y.to(out_ptr.dtype.element_ty), mask=mask)


# Enough programs to cover two waves of an H100/H200's 132 SMs before larger blocks are used.
_MIN_PROGRAMS = 264


def launch_config(n_tokens: int, inter: int) -> tuple[int, int]:
    """(BLOCK columns per program, num_warps) for x [n_tokens, 2 * inter]."""
    block = min(1024, triton.next_power_of_2(max(inter, 1)))
    # Small decode batches: shrink blocks (not below 256) so more SMs share the row.
    while block > 256 and n_tokens * triton.cdiv(inter, block) < _MIN_PROGRAMS:
        block //= 2
    # 8 elements per thread: one 16-byte load of bf16 per input.
    num_warps = min(4, max(1, block // 256))
    return block, num_warps


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] (gate, then up) -> silu(gate) * up [T, I] in x's dtype; `out` may be given."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2 * I], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    n_tokens, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((n_tokens, inter), dtype=x.dtype, device=x.device)
    elif out.shape != (n_tokens, inter) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be {x.dtype} [{n_tokens}, {inter}] on {x.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if n_tokens == 0 or inter == 0:
        return out
    block, num_warps = launch_config(n_tokens, inter)
    _silu_and_mul_kernel[(n_tokens, triton.cdiv(inter, block))](
        x, out, inter, *x.stride(), *out.stride(), BLOCK=block, num_warps=num_warps
    )
    return out
