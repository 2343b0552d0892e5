"""Compile Triton kernel variants before their first launch, many at once.

Triton compiles a variant the first time a launch needs it, one after another, each taking
0.3-1 s of CPU (ttir -> ttgir -> llvm -> ptx -> ptxas). A start-up that meets twenty variants pays
that in series. Here a start-up first runs its dummy batches *dry*: Triton's `jit_cache_hook`
(called before every compilation) records each variant a launch would compile and tells Triton
to skip it, so the launch neither compiles nor runs. The recorded variants are then compiled in
a thread pool through Triton's own asynchronous mode (`AsyncCompileMode` with
`JITFunction.preload`, the path PyTorch uses to load kernels ahead): most of a compilation runs
outside the GIL (MLIR passes, ptxas), so the pool scales with the cores. The next real launch of
each variant finds it compiled in memory; one found in Triton's on-disk cache is only loaded.

A dry run skips the variants it records, so their outputs are whatever memory held: the steps
run dry must not act on kernel outputs on the host, and may feed garbage only into kernels and
dense math (ember's GPU steps never read device values on the host: they are graph-safe).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

Variant = tuple[Any, str]
"""(the JITFunction, Triton's serialized specialization of one variant)."""


def default_workers() -> int:
    """Compile threads: every core but one (the process's own Python keeps one busy)."""
    return max(1, min(32, (os.cpu_count() or 2) - 1))


@contextlib.contextmanager
def recording() -> Iterator[dict[tuple[int, str], Variant]]:
    """Within: a launch whose variant is not compiled in this process is recorded (once) and
    skipped, neither compiled nor run. Yields the record, filled as launches happen."""
    from triton import knobs

    found: dict[tuple[int, str], Variant] = {}

    def hook(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        data = compile["specialization_data"]
        found.setdefault((id(fn.jit_function), data), (fn.jit_function, data))
        return True  # Triton: skip this compilation, and the launch that needed it

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield found
    finally:
        knobs.runtime.jit_cache_hook = previous


def compile_all(variants: list[Variant], workers: int | None = None) -> None:
    """Compile (or load from Triton's on-disk cache) each variant, `workers` at a time; each ends
    up in its kernel's in-memory cache, where the next launch finds it."""
    if not variants:
        return
    from triton.runtime._async_compile import AsyncCompileMode

    # The pool is left after the mode: AsyncCompileMode's exit waits for every compilation and
    # files each result in its kernel's cache (on this thread).
    with (
        ThreadPoolExecutor(
            workers or default_workers(), thread_name_prefix="triton-compile"
        ) as pool,
        AsyncCompileMode(pool),
    ):
        for fn, data in variants:
            fn.preload(data)


def precompile(run_dry: Callable[[], object], workers: int | None = None) -> int:
    """Run `run_dry` recording the variants it would compile, then compile them in parallel.
    Returns how many there were (0 where Triton runs in its interpreter: no hook is called, and
    `run_dry` simply ran)."""
    with recording() as found:
        run_dry()
    compile_all(list(found.values()), workers)
    return len(found)
