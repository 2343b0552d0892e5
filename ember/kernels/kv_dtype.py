"""How a KV cache of another dtype than the model's stores its elements (FP8 E4M3: one byte,
saturating at +-FP8_MAX; `EngineConfig.kv_cache_dtype`). Plain PyTorch: the CPU path and the
kernels' references write through it; the Triton writers saturate alike."""

from __future__ import annotations

import torch

FP8_MAX = 448.0
"""The largest finite FP8 E4M3 value: an FP8 cache's elements saturate there rather than
overflowing to NaN."""


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a KV cache of `dtype` stores it."""
    if dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)
