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
