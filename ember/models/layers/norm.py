"""RMSNorm, computed in fp32 as Hugging Face does, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from ember.kernels.dispatch import use_triton


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With `residual`, returns (norm(x + residual), x + residual) for the next block;
        without, `out` (any strides) may receive norm(x)."""
        if use_triton(x):
            from ember.kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual, out=out)
        if residual is None:
            return self._norm(x) if out is None else out.copy_(self._norm(x))
        x = x + residual
        return self._norm(x), x
