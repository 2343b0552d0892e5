"""When the model layers take the Triton kernels instead of their plain-PyTorch references."""

from __future__ import annotations

import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA device and EMBER_DISABLE_TRITON is not "1".

    The variable is read on every call (a dict lookup), so tests and benchmarks can flip it
    without re-importing anything.
    """
    return t.is_cuda and os.environ.get("EMBER_DISABLE_TRITON") != "1"


def dot_precision(dtype: torch.dtype) -> str:
    """`input_precision` of the attention kernels' tl.dot: fp32 inputs stay fp32 ("ieee", the
    references' precision); bf16/fp16 use the tensor cores as they are ("tf32" is ignored)."""
    return "ieee" if dtype == torch.float32 else "tf32"
