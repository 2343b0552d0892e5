"""When the model layers take the Triton kernels instead of their plain-PyTorch references."""

from __future__ import annotations

import functools
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


@functools.cache
def _properties(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


def capability(t: torch.Tensor) -> tuple[int, int]:
    """The compute capability of t's CUDA device (cached: the kernels ask on every launch)."""
    return _properties(t.device.index or 0)[0]


def num_sms(t: torch.Tensor) -> int:
    """The streaming multiprocessors of t's CUDA device (cached)."""
    return _properties(t.device.index or 0)[1]
