"""Run a function in N processes that form an engine's process group (gloo on the CPU), as the
ranks of a tensor-parallel engine do, and collect what each returns."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    size: int,
    init_method: str,
    expert_parallel: bool,
    args: tuple,
    results: Any,
) -> None:
    from ember.distributed import state

    torch.set_num_threads(1)
    try:
        state.init(rank, size, init_method, torch.device("cpu"), expert_parallel, timeout_s=120)
        results.put((rank, "ok", _detached(fn(*args))))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        state.close()


@dataclass(frozen=True)
class _Array:
    """A rank's tensor on its way to the parent as a NumPy array: a queued tensor travels as a
    handle to shared memory that the rank's exit may free before the parent reads it."""

    array: np.ndarray


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Array(value.detach().cpu().numpy().copy())
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


def _attached(value: Any) -> Any:
    if isinstance(value, _Array):
        return torch.from_numpy(value.array)
    if isinstance(value, dict):
        return {k: _attached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_attached(v) for v in value)
    return value


def run_ranks(
    size: int,
    fn: Callable[..., Any],
    *args: Any,
    expert_parallel: bool = False,
    timeout_s: float = 300.0,
) -> list[Any]:
    """fn(*args) on ranks 0..size-1, each a spawned process in the group; their results in rank
    order (picklable). A rank that raises fails the call with its traceback."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    fd, path = tempfile.mkstemp(prefix="ember-ranks-")
    os.close(fd)
    os.unlink(path)  # the file store creates it
    init = f"file://{path}"
    procs = [
        ctx.Process(
            target=_rank_main, args=(fn, r, size, init, expert_parallel, args, results), daemon=True
        )
        for r in range(size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(size):
            rank, status, value = results.get(timeout=timeout_s)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if os.path.exists(path):
            os.unlink(path)
    if errors:
        raise AssertionError("\n".join(errors))
    return [_attached(out[r]) for r in range(size)]
