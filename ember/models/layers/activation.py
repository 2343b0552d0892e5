"""Gated activations: the MLP's gate and up halves fused into one input."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ember.kernels.dispatch import use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from ember.kernels.activation import silu_and_mul as fused

        if x.dim() == 2:
            return fused(x)
        return fused(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], x.shape[-1] // 2)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


ACTIVATIONS = {"silu": silu_and_mul}


def gated_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unsupported hidden_act {name!r} (supported: {sorted(ACTIVATIONS)})"
        ) from None
