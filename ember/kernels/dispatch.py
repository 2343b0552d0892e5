"""When the model layers take the Triton kernels instead of their plain-PyTorch references."""

from __future__ import annotations

import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA device and EMBER_DISABLE_TRITON is not "1"; for tests, also
    on the CPU when EMBER_TRITON_ON_CPU and TRITON_INTERPRET are both "1" (the kernels then run
    in Triton's interpreter, so the GPU path's wiring runs where there is no GPU).

    The variable is read on every call (a dict lookup), so tests and benchmarks can flip it
    without re-importing anything.
    """
    if os.environ.get("EMBER_DISABLE_TRITON") == "1":
        return False
    return t.is_cuda or (
        os.environ.get("EMBER_TRITON_ON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1"
    )


LOG2E = 1.4426950408889634
"""The attention kernels work in exp2: their softmax scale is multiplied by log2(e)."""


def dot_precision(dtype: torch.dtype) -> str:
    """`input_precision` of the attention kernels' tl.dot: fp32 inputs stay fp32 ("ieee", the
    references' precision); bf16/fp16 use the tensor cores as they are ("tf32" is ignored)."""
    return "ieee" if dtype == torch.float32 else "tf32"
