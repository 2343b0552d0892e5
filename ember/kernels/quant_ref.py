"""Quantized weights' math in plain PyTorch: the reference of every quantized kernel
(ember/kernels/int_gemm.py, fp8_gemm.py, fused_moe.py) and the CPU path of quantized layers.

Two formats, stored on the device as the checkpoint publishes them:

- **INT, packed** (compressed-tensors `pack-quantized`, bits 4 or 8): `packed` int32
  [..., N, K * bits / 32]; element j of a row sits in word j // (32 / bits) at bit
  (j % (32 / bits)) * bits, stored as q + 2**(bits - 1) for q in [-2**(bits-1), 2**(bits-1) - 1].
  `scale` [..., N, K / group] (the checkpoint's float dtype), `zero_point` int8 [..., N, K / group]
  in q's range, or None (symmetric). The weight is (q - zero_point) * scale, computed as
  compressed-tensors does (in the scale's dtype: exact for the integers, one rounding for the
  product) and rounded to the activations' dtype. A channel-wise weight has group = K.
- **FP8** (e4m3): `weight` float8_e4m3fn [..., N, K] and `scale` float32
  [..., ceil(N / block_n), ceil(K / block_k)]: one scale per block, edge blocks partial.
  DeepSeek-V3 / Kimi K2 blocks are 128 x 128; a channel-wise weight is (1, K), a per-tensor one
  is stored channel-wise (its scale repeated down the rows). Activations are quantized as they
  arrive, one float32 scale per `act_group` elements of a row (128 for block weights, K for
  per-token): scale = max(|x|) / 448 over the group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT_BITS = (4, 8)
FP8_MAX = 448.0
"""The largest float8_e4m3fn."""
FP8_SCALE_EPS = 1e-10
"""A group of zeros gets this scale rather than 0 (so x / scale stays finite)."""


def per_word(bits: int) -> int:
    """Values packed in one int32."""
    if bits not in INT_BITS:
        raise ValueError(f"packed INT weights of {bits} bits are not supported (4 or 8)")
    return 32 // bits


def unpack_int(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """[..., N, K * bits / 32] int32 -> [..., N, k] int8 in [-2**(bits-1), 2**(bits-1) - 1]."""
    n = per_word(bits)
    shifts = torch.arange(n, device=packed.device, dtype=torch.int32) * bits
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., N, W, n]
    values = values.flatten(-2)[..., :k] - (1 << (bits - 1))
    return values.to(torch.int8)


def unpack_int_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Values packed down the rows (compressed-tensors packs zero points so):
    [..., rows * bits / 32, C] int32 -> [..., rows, C] int8."""
    return unpack_int(packed.transpose(-1, -2), bits, rows).transpose(-1, -2).contiguous()


def pack_int(values: torch.Tensor, bits: int) -> torch.Tensor:
    """unpack_int's inverse: int8 [..., N, K] in q's range -> int32 [..., N, ceil(K / per)]."""
    n = per_word(bits)
    k = values.shape[-1]
    padded = F.pad(values.to(torch.int32) + (1 << (bits - 1)), (0, -k % n))
    words = padded.view(*values.shape[:-1], -1, n)
    shifts = torch.arange(n, device=values.device, dtype=torch.int32) * bits
    # The fields do not overlap: their sum is their bitwise or (int32 wraps like the words).
    return (words << shifts).sum(-1, dtype=torch.int32)


def dequantize_int(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bits: int,
    group_size: int,
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The real weight [..., N, k] of a packed INT weight, in `dtype`."""
    q = unpack_int(packed, bits, k).to(scale.dtype)
    if zero_point is not None:
        q = q - zero_point.to(scale.dtype).repeat_interleave(group_size, -1)[..., :k]
    return (q * scale.repeat_interleave(group_size, -1)[..., :k]).to(dtype)


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The real weight [..., N, K] of an FP8 weight with one scale per `block` (rows, cols)."""
    rows, cols = block
    *_, n, k = weight.shape
    s = scale.float().repeat_interleave(rows, -2)[..., :n, :]
    s = s.repeat_interleave(cols, -1)[..., :k]
    return (weight.float() * s).to(dtype)


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [M, K] -> (float8_e4m3fn [M, K], float32 scales
    [M, ceil(K / group)]), one scale per `group` elements of a row."""
    m, k = x.shape
    xf = F.pad(x.float(), (0, -k % group)).view(m, -1, group)
    scale = xf.abs().amax(-1).clamp(min=FP8_SCALE_EPS) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, -1)[:, :k].contiguous(), scale


def dequantize_fp8_groups(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """quantize_fp8_groups' values back in float32."""
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(group, -1)[..., :k]


def int_matmul_ref(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """x [M, K] @ W.T for a packed INT weight W [N, K]: the weight dequantized to x's dtype,
    then F.linear (the dequantized model's matmul)."""
    w = dequantize_int(packed, scale, zero_point, bits, group_size, x.shape[-1], x.dtype)
    return F.linear(x, w)


def fp8_matmul_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    act_group: int,
) -> torch.Tensor:
    """x [M, K] @ W.T for an FP8 weight, in float32, rounded to x's dtype. `act_group` > 0: x is
    first quantized to FP8 with one scale per `act_group` elements of a row (W8A8), as the
    kernels do; 0: x as it is (weight-only FP8)."""
    if act_group:
        xq, xs = quantize_fp8_groups(x, act_group)
        xf = dequantize_fp8_groups(xq, xs, act_group)
    else:
        xf = x.float()
    return (xf @ dequantize_fp8(weight, scale, block, torch.float32).T).to(x.dtype)


def routed_experts_fp8_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    block: tuple[int, int],
) -> torch.Tensor:
    """The per-expert loop of a MoE over FP8 block experts, W8A8 as fused_moe_fp8 computes it:
    each projection's input quantized per token group of block[1] (fp8_matmul_ref), its result
    rounded to x's dtype; silu(gate) * up in x's dtype. x [T, H]; w13 [E, 2I, H], w2 [E, H, I]
    with their block scales; weights and experts [T, k]. Host syncs: eager only."""
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        token_idx, slot = torch.where(experts == e)
        gate, up = fp8_matmul_ref(x[token_idx], w13[e], w13_scale[e], block, block[1]).chunk(2, -1)
        h = F.silu(gate) * up
        y = fp8_matmul_ref(h, w2[e], w2_scale[e], block, block[1])
        out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
    return out
