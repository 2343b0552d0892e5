"""The collectives of the parallel layers, over the current state's group: each is the identity
on one rank, so a one-device model runs the same code with nothing launched.

They are plain torch.distributed calls: NCCL's are captured by CUDA graphs (ember's decode and
piecewise graphs capture them with the layers), gloo's run eagerly on the CPU."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ember.distributed.state import current


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks, in place; returns `x`."""
    s = current()
    if s.group is None:
        return x
    dist.all_reduce(x, group=s.group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` (the same shape on each) concatenated along `dim`, in rank order."""
    s = current()
    if s.group is None:
        return x
    x = x.contiguous()
    out = torch.empty((s.size, *x.shape), dtype=x.dtype, device=x.device)
    if x.is_cuda:
        dist.all_gather_into_tensor(out, x, group=s.group)
    else:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.unbind(0)), x, group=s.group)
    dim = dim % x.dim()
    # [size, ..., d, ...] -> [..., size * d, ...]
    return out.movedim(0, dim).reshape(*x.shape[:dim], s.size * x.shape[dim], *x.shape[dim + 1 :])


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """`x` of rank `src` on every rank, in place; returns `x`."""
    s = current()
    if s.group is None:
        return x
    dist.broadcast(x, src=src, group=s.group)
    return x


def all_reduce_min(value: int) -> int:
    """The least of an int over the ranks (start-up: the KV blocks every rank has room for)."""
    s = current()
    if s.group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend(s.group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=s.group)
    return int(t.item())
