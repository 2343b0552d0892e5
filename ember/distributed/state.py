"""The parallel state of this process: its rank among the engine's devices, their number, the
torch.distributed group they form, and whether MoE experts are split by expert (expert parallel)
rather than each expert's width (tensor parallel).

`torch.distributed` with NCCL on GPUs and gloo on the CPU (so CI runs the same code in several
processes). One process a rank; `init` once per process, before the model is built."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class ParallelState:
    rank: int = 0
    size: int = 1
    """Tensor-parallel size: the engine's devices (one process each)."""
    expert_parallel: bool = False
    """MoE layers hold E / size whole experts a rank (else every expert, 1 / size of its width)."""
    dp_attention: bool = False
    """Multi-head latent attention runs data-parallel: each rank holds every head and computes
    attention for its own requests over its own latent cache (ember/engine/dp_attention.py)."""
    group: dist.ProcessGroup | None = None
    """The ranks' group (None for one rank: no collective runs)."""

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: the engine core's process, which schedules, samples and answers."""
        return self.rank == 0


_current = ParallelState()


def current() -> ParallelState:
    return _current


def init(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device,
    expert_parallel: bool = False,
    dp_attention: bool = False,
    timeout_s: float = 600.0,
    make_current: bool = True,
) -> ParallelState:
    """Join the engine's process group (`init_method`: "tcp://HOST:PORT" or "file://PATH", the
    same for every rank) as `rank` of `size`: NCCL on a CUDA `device`, gloo elsewhere. A rank
    that does not arrive within `timeout_s` fails every other rank's first collective.
    `make_current`: the state `current()` returns from now on (a worker process's, which holds
    one engine); else the caller makes it current where it runs its engine (`use`: a process
    may hold other engines, of one rank, whose layers must not meet the group)."""
    global _current
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} of {size} is not a rank")
    group = None
    if size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
        group = dist.group.WORLD
    made = ParallelState(rank, size, expert_parallel, dp_attention, group)
    if make_current:
        _current = made
    return made


def close() -> None:
    """Leave the process group (the engine's end; one tensor-parallel engine a process); the
    state is one rank again."""
    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = ParallelState()


@contextlib.contextmanager
def use(state: ParallelState) -> Iterator[ParallelState]:
    """Within: `current()` is `state` (tests build one rank's model in a process of its own;
    a state without a group builds a rank's shapes without collectives)."""
    global _current
    saved, _current = _current, state
    try:
        yield state
    finally:
        _current = saved
