"""Compile Triton kernel variants before their first launch, many at once.

Triton compiles a variant the first time a launch needs it, one after another, each taking
0.3-1 s of CPU (ttir -> ttgir -> llvm -> ptx -> ptxas). A start-up that meets twenty variants pays
that in series. Here a start-up first runs its dummy batches *dry*: Triton's `jit_cache_hook`
(called before every compilation) records each variant a launch would compile and tells Triton
to skip it, so the launch neither compiles nor runs. Each recorded variant starts compiling at
once, while the dry run goes on, in a thread pool through Triton's own asynchronous mode
(`AsyncCompileMode` with `JITFunction.preload`, which rebuilds a variant from its serialized
specialization): most of a compilation runs outside the GIL (MLIR passes, ptxas), so the pool
scales with the cores (two threads compiled two prefill variants in 0.92 s where one took 1.64 s,
on a 2-core machine). The same pool then builds each variant's launcher and loads its binary.
The next real launch of each variant finds it compiled and loaded in memory; one found in
Triton's on-disk cache is only loaded. With `processes`, each variant compiles in a worker
process forked from this one (ember/kernels/compile_workers.py), out of this process's GIL, and
the pool's thread only waits for it and loads it from the cache.

A dry run launches no Triton kernel of ember's at all: variants already compiled are hidden
from their kernels' in-memory caches for its length (else they would run on the outputs of
skipped ones: garbage expert ids are out-of-bounds addresses), and each variant met is filed as a
no-op until the run ends. So outputs are whatever memory held: the steps run dry must not act on
kernel outputs on the host, and may feed garbage only into kernels and dense math (ember's GPU
steps never read device values on the host: they are graph-safe).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.kernels.compile_log import PRECOMPILE_THREADS, compiled_elsewhere

if TYPE_CHECKING:
    from ember.kernels.compile_workers import Compiled, CompileWorkers

log = logging.getLogger(__name__)

Variant = tuple[Any, str]
"""(the JITFunction, Triton's serialized specialization of one variant)."""


def default_workers() -> int:
    """Compile threads: every core but one (the process's own Python keeps one busy)."""
    return max(1, min(32, (os.cpu_count() or 2) - 1))


class _Skipped:
    """What a kernel's cache holds for a variant during a dry run: launching it does nothing."""

    function = None
    packed_metadata = None

    def launch_metadata(self, *args: Any) -> None:
        return None

    def run(self, *args: Any) -> None:
        return None


_SKIPPED = _Skipped()


def _loaded_kernels() -> list[Any]:
    """Every Triton kernel of ember's imported so far."""
    from triton.runtime.jit import JITFunction

    kernels = []
    for name, module in list(sys.modules.items()):
        if name.startswith("ember.") and module is not None:
            kernels += [v for v in vars(module).values() if isinstance(v, JITFunction)]
    return kernels


def _caches(fn: Any) -> list[dict]:
    return [entry[0] for entry in fn.device_caches.values()]


@contextlib.contextmanager
def recording(
    kernels: list[Any] | None = None, on_found: Callable[[Any, str], None] | None = None
) -> Iterator[dict[tuple[int, str], Variant]]:
    """Within: no Triton kernel of ember's runs; each variant a launch meets that was not compiled
    in this process is recorded, once. Yields the record, filled as launches happen; on exit
    every kernel's in-memory cache is as it was. `kernels`: those that may hold compiled variants
    (every one of ember's imported so far by default). `on_found(kernel, data)`: called as each
    variant is first met; a `kernel.preload(data)` made there compiles it (the hook lets a
    preload through), so the compile can start while the dry run goes on."""
    from triton import knobs

    found: dict[tuple[int, str], Variant] = {}
    hidden: dict[int, tuple[Any, list[dict]]] = {}  # id(kernel) -> (kernel, its caches' entries)
    preloading = False

    def hide(fn: Any) -> None:
        if id(fn) not in hidden:
            caches = _caches(fn)
            hidden[id(fn)] = (fn, [dict(c) for c in caches])
            for c in caches:
                c.clear()

    def hook(*, key: Any, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        nonlocal preloading
        if preloading:
            return False  # on_found's own preload: Triton compiles it
        kernel = fn.jit_function
        hide(kernel)  # a kernel first imported during the run
        compiled = any(key in saved for saved in hidden[id(kernel)][1])
        data = compile["specialization_data"]
        if not compiled and (id(kernel), data) not in found:
            found[(id(kernel), data)] = (kernel, data)
            if on_found is not None:
                preloading = True
                try:
                    on_found(kernel, data)
                finally:
                    preloading = False
        kernel.device_caches[compile["device"]][0][key] = _SKIPPED  # later launches: no-ops
        return True  # Triton: skip this compilation, and the launch that needed it

    for kernel in _loaded_kernels() if kernels is None else kernels:
        hide(kernel)
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield found
    finally:
        knobs.runtime.jit_cache_hook = previous
        for kernel, saved in hidden.values():
            caches = _caches(kernel)
            for c in caches:
                c.clear()
            for c, before in zip(caches, saved, strict=False):
                c.update(before)


# Each compiled variant's first launch would then build its launcher (a C file that Triton
# compiles with the system's compiler, once per argument signature, cached on disk) and load its
# binary: serially, on the launching thread. On an empty cache that was ~1.5 s of an H100's first
# profiled step; `precompile` does both in its pool.
def _unloaded(kernels: Any) -> list[tuple[int, Any]]:
    """(device, compiled variant) of each variant of `kernels` not loaded for its first launch."""
    return [
        (device, compiled)
        for fn in kernels
        for device, entry in fn.device_caches.items()
        for compiled in list(entry[0].values())
        if compiled is not _SKIPPED and getattr(compiled, "module", True) is None
    ]


def _load(device: int, compiled: Any) -> None:
    """Build the variant's launcher and load its binary onto `device`, as its first launch would
    (Triton's `CompiledKernel._init_handles`, idempotent). A failure (too much shared memory for
    the card) is left for the launch to raise, as without this."""
    with contextlib.suppress(Exception):
        _set_device(device)
        compiled._init_handles()


def _set_device(device: int) -> None:
    """The pool thread's CUDA device (Triton loads onto torch's current device, per thread)."""
    import torch

    torch.cuda.set_device(device)


@dataclass(frozen=True)
class Precompiled:
    variants: int
    """Variants the dry run met that were not compiled in this process yet."""
    dry_s: float
    """Seconds of the dry run (its dense math, and Python's launches of skipped kernels), while
    the variants it met began to compile."""
    compile_s: float
    """Seconds after the dry run until every variant was compiled (or loaded from the on-disk
    cache) and its launcher built, in parallel."""
    compiled_s: float = 0.0
    """Seconds from the dry run's start until the last variant was compiled (or loaded), before
    the launchers were built."""
    workers: int = 0
    """Worker processes forked to compile (0: in threads only)."""
    fork_s: float = 0.0
    """Seconds the dry run's thread spent forking them."""
    timeline: tuple[tuple[str, float, float], ...] = ()
    """(kernel name, seconds from the dry run's start to the variant's first meeting, to its
    compile's end) of each variant compiled in the pool: the start-up's critical path is the
    one that ends last."""

    def critical(self, n: int = 4) -> str:
        """The `n` variants whose compiles ended last and the first one met, as a phrase for
        the start-up log."""
        if not self.timeline:
            return "none"
        first = min(self.timeline, key=lambda t: t[1])
        last = sorted(self.timeline, key=lambda t: t[2], reverse=True)[:n]
        ends = ", ".join(
            f"{name} (met {met:.1f} s in, done {done:.1f} s)" for name, met, done in last
        )
        return f"{ends}; the first met {first[1]:.2f} s in ({first[0]})"


class _Pool(ThreadPoolExecutor):
    """The compile threads. A compile submitted while `after` holds a compile worker's future
    waits for it first (the worker compiles the variant into the on-disk cache; the thread
    then only loads it), unless the cache holds it already, and compiles the variant itself if
    the worker failed."""

    after: tuple[Future[Compiled], Callable[[], bool]] | None = None
    """(the worker's future, whether the variant was in the on-disk cache before its job
    reached a worker)."""
    label: tuple[str, float] | None = None
    """(kernel name, perf_counter() when the dry run met it) of the compile submitted next."""
    last_done: float = 0.0
    """perf_counter() when the last compile submitted here finished."""

    def __init__(self, workers: int, thread_name_prefix: str) -> None:
        super().__init__(workers, thread_name_prefix=thread_name_prefix)
        self.timeline: list[tuple[str, float, float]] = []
        """(kernel name, perf_counter() met, perf_counter() compiled) of each compile."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        remote, self.after = self.after, None
        label, self.label = self.label, None
        return super().submit(self._timed, remote, label, fn, *args, **kwargs)

    def _timed(
        self,
        remote: tuple[Future[Compiled], Callable[[], bool]] | None,
        label: tuple[str, float] | None,
        fn: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        try:
            return fn(*args, **kwargs) if remote is None else _after(remote, fn, *args, **kwargs)
        finally:
            done = time.perf_counter()
            self.last_done = max(self.last_done, done)
            if label is not None:
                self.timeline.append((*label, done))  # list.append: atomic under the GIL


def _after(
    remote: tuple[Future[Compiled], Callable[[], bool]],
    fn: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    future, cached = remote
    # A warm start: load it now, whatever its worker does with it (`cached`: in the cache before
    # any worker began the job). A worker that has begun it or answered says itself whether it
    # compiled the variant: then it is counted as compiled.
    if not future.done() and cached():
        return fn(*args, **kwargs)
    try:
        done = future.result()
    except Exception as e:  # the worker could not compile it: this thread does
        log.debug("compile worker failed a variant (compiling it here): %s", e)
        return fn(*args, **kwargs)
    with compiled_elsewhere(None if done.cache_hit else done.seconds):
        return fn(*args, **kwargs)


def precompile(
    run_dry: Callable[[], object],
    workers: int | None = None,
    processes: bool = False,
    procs: CompileWorkers | None = None,
) -> Precompiled:
    """Run `run_dry`, compiling in parallel each variant it would compile as it is met (the
    compiles run while the dry run goes on), then build the variants' launchers and load them.
    `processes`: compile in up to `workers` processes forked from this one as they are needed
    (the threads then load what they compiled). `procs`: compile in these workers, which may
    be compiling variants submitted before (`warmup.compile_probes_early`; one the dry run meets
    again is waited for, not compiled twice); closed at the end either way. (Where Triton runs
    in its interpreter no hook is called: `run_dry` simply runs, and no variant is found.)"""
    from triton.runtime._async_compile import AsyncCompileMode

    from ember.kernels.compile_workers import CompileWorkers, cached

    t0 = time.perf_counter()
    workers = workers or default_workers()
    if procs is None and processes:
        procs = CompileWorkers(workers)
    target = None
    if procs is not None:
        from triton.runtime import driver

        target = driver.active.get_current_target()

    with _Pool(workers, thread_name_prefix=PRECOMPILE_THREADS) as pool:

        def on_found(kernel: Any, data: str) -> None:
            future = None if procs is None else procs.submit(kernel, data, target)
            if future is not None:
                # In the cache while its job still waits for a worker: an earlier start's, to
                # load now. Once a worker has the job, its answer says who compiled it (a
                # worker that filed it but has not answered yet would look like a cache hit).
                pool.after = (future, lambda: cached(kernel, data, target) and procs.queued(future))
            pool.label = (getattr(kernel, "__name__", "?"), time.perf_counter())
            try:
                kernel.preload(data)  # under the async mode: submits its compile to the pool
            finally:
                pool.after = pool.label = None  # a preload that submitted nothing (a duplicate)

        # The mode's exit waits for every compile and files each in its kernel's cache: after
        # the recording's exit has put the caches back as they were.
        try:
            with AsyncCompileMode(pool):
                with recording(on_found=on_found) as found:
                    run_dry()
                t1 = time.perf_counter()
        finally:
            if procs is not None:
                procs.close()  # every compile is in: the workers exit
        compiled_s = max(pool.last_done, t1) - t0  # the mode's exit waited for every compile
        kernels = {id(fn): fn for fn, _ in found.values()}.values()
        list(pool.map(lambda job: _load(*job), _unloaded(kernels)))
    forked = procs.forked if procs is not None else 0
    fork_s = procs.fork_s if procs is not None else 0.0
    timeline = tuple(sorted((n, met - t0, done - t0) for n, met, done in pool.timeline))
    return Precompiled(
        len(found), t1 - t0, time.perf_counter() - t1, compiled_s, forked, fork_s, timeline
    )
