"""FP8 block-quantized checkpoints (DeepSeek-V3 / Kimi K2 as published), dequantized at load time.

Each quantized weight `X.weight` is stored float8_e4m3fn with a float32 `X.weight_scale_inv` of
one scale per (rows, cols) block, edge blocks partial; the real weight is the fp8 value times its
block's scale. Weights left unquantized (embeddings, lm_head, norms, the MoE router) have no scale.
ember has no FP8 matmuls yet, so the weights are dequantized to the model's dtype as they load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

SCALE_SUFFIX = "_scale_inv"


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.element_size() == 1


def dequantize_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    dtype: torch.dtype,
    name: str = "weight",
) -> torch.Tensor:
    """`weight` (fp8, [..., rows, cols]) times the scale of its block, in `dtype`."""
    rows, cols = block_size
    if weight.dim() < 2:
        raise ValueError(f"FP8 weight {name!r} has shape {tuple(weight.shape)}, not a matrix")
    *lead, out_dim, in_dim = weight.shape
    expected = (*lead, -(-out_dim // rows), -(-in_dim // cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"{name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; weight {name!r} of shape "
            f"{tuple(weight.shape)} in blocks of {rows}x{cols} needs {expected}"
        )
    scale = scale_inv.float().repeat_interleave(rows, -2)[..., :out_dim, :]
    scale = scale.repeat_interleave(cols, -1)[..., :in_dim]
    return (weight.float() * scale).to(dtype)


def dequantize_fp8(
    weights: Iterable[tuple[str, torch.Tensor]],
    block_size: tuple[int, int] | None,
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each fp8 weight and its scale replaced by the dequantized
    weight, so models never see either. A weight and its scale may sit in different shards, in
    either order: whichever comes first waits (still fp8) for the other. With `block_size` None
    (no quantization_config) an fp8 tensor or a scale is an error."""
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        is_scale = name.endswith(SCALE_SUFFIX)
        if not (is_scale or is_fp8(tensor)):
            yield name, tensor
            continue
        if block_size is None:
            raise ValueError(
                f"checkpoint tensor {name!r} ({tensor.dtype}) is FP8-quantized, but config.json "
                "has no quantization_config"
            )
        if is_scale:
            weight_name = name.removesuffix(SCALE_SUFFIX)
            weight = waiting_weights.pop(weight_name, None)
            if weight is None:
                waiting_scales[weight_name] = tensor
                continue
            scale = tensor
        else:
            weight_name, weight = name, tensor
            scale = waiting_scales.pop(name, None)
            if scale is None:
                waiting_weights[name] = tensor
                continue
        yield weight_name, dequantize_blocks(weight, scale, block_size, dtype, weight_name)
    if waiting_weights:
        name = sorted(waiting_weights)[0]
        raise ValueError(
            f"FP8 weight {name!r} has no {name + SCALE_SUFFIX!r} in the checkpoint "
            f"({len(waiting_weights)} fp8 weight(s) without a scale)"
        )
    if waiting_scales:
        name = sorted(waiting_scales)[0]
        raise ValueError(
            f"{name + SCALE_SUFFIX!r} has no FP8 weight {name!r} to scale in the checkpoint "
            f"({len(waiting_scales)} scale(s) without an fp8 weight)"
        )
