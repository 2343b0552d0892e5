"""Where Triton keeps its compiled kernels, and a count of what it compiles and when.

Triton compiles a kernel variant (a kernel at one set of constexprs and argument
specializations) the first time a launch needs it, and keeps the binary in its cache, keyed by
the kernel's source, the GPU's architecture, Triton's version and the options. ember points that
cache into its home ($EMBER_HOME/triton, ~/.cache/ember/triton) unless TRITON_CACHE_DIR is set, so
a second start on the same machine loads what the first compiled.

`CompileLog` listens to every compilation (`triton.knobs.compilation.listener`): how many variants
were compiled and how many came from the cache, and, once the engine says it is ready, each
variant still compiled later, on the request path, is logged by name and specialization: those
are the ones a start-up warm-up should reach, or a kernel argument that should not specialize.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ember.home import ember_home

log = logging.getLogger(__name__)

PRECOMPILE_THREADS = "triton-compile"
"""The name prefix of ember/kernels/precompile.py's compile threads."""

_elsewhere = threading.local()


@contextlib.contextmanager
def compiled_elsewhere(seconds: float | None) -> Iterator[None]:
    """Within (on this thread): a cache hit is a variant another process compiled just now for
    this one (ember/kernels/compile_workers.py), in `seconds`; counted as compiled, not loaded.
    None: nothing was compiled elsewhere (a hit is a hit)."""
    _elsewhere.seconds = seconds
    try:
        yield
    finally:
        _elsewhere.seconds = None


def use_ember_cache() -> str:
    """Point Triton's cache into ember's home unless the user chose one; returns the directory.
    Set in the environment, so the engine-core processes started after this inherit it."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(ember_home() / "triton")
    return os.environ["TRITON_CACHE_DIR"]


def describe(src: Any) -> str:
    """A compiled variant by name and what it was specialized on: constexprs and arguments made
    constants (an int equal to 1), and the arguments Triton took as divisible by 16 (an int or
    a pointer's address), e.g. `_prefill_kernel(BLOCK_M=64, num_seqs=1; 16 | q_ptr, stride_bt)`."""
    name = getattr(src, "name", "?")
    fn = getattr(src, "fn", None)
    names = list(getattr(fn, "arg_names", []))

    def arg(key: Any) -> str:
        i = key[0] if isinstance(key, tuple) and key else key
        return names[i] if isinstance(i, int) and i < len(names) else str(key)

    consts = [f"{arg(k)}={v}" for k, v in getattr(src, "constants", {}).items()]
    aligned = [
        arg(k)
        for k, hints in getattr(src, "attrs", {}).items()
        if any(h and h[0] == "tt.divisibility" for h in hints)
    ]
    return f"{name}({', '.join(consts)}; 16 | {', '.join(aligned)})" if fn else name


def _seconds(times: Any) -> float:
    """A compilation's seconds from Triton's CompileTimes (0 where it gives none)."""
    if times is None:
        return 0.0
    stages = getattr(times, "lowering_stages", []) or []
    total = getattr(times, "ir_initialization", 0) + getattr(times, "store_results", 0)
    return (total + sum(d for _, d in stages)) / 1e6  # Triton reports microseconds


@dataclass
class CompileLog:
    compiled: int = 0
    """Variants compiled (cache misses) since the engine's start began."""
    loaded: int = 0
    """Variants loaded from the on-disk cache."""
    compile_s: float = 0.0
    """Seconds spent compiling (Triton's own timer), since the start began."""
    late: list[str] = field(default_factory=list)
    """Variants compiled after `ready()` (on the request path), by `describe()`."""
    since_mark: list[str] = field(default_factory=list)
    """Variants compiled at their first launch since `mark()` (not ahead, by precompile's
    threads), by `describe()`."""
    is_ready: bool = False

    def begin(self) -> None:
        """An engine's start begins: count its compilations afresh (a process may start more
        than one engine, one after another)."""
        self.compiled, self.loaded, self.compile_s, self.late = 0, 0, 0.0, []
        self.since_mark = []
        self.is_ready = False

    def mark(self) -> None:
        """Start a list of what is compiled from now on (`since_mark`; `ready()` logs it)."""
        self.since_mark = []

    def __call__(
        self,
        *,
        src: Any,
        metadata: dict[str, Any],
        metadata_group: dict[str, str],
        times: Any,
        cache_hit: bool,
    ) -> None:
        elsewhere = getattr(_elsewhere, "seconds", None)
        if cache_hit and elsewhere is None:
            self.loaded += 1
            return
        self.compiled += 1
        self.compile_s += elsewhere if cache_hit and elsewhere is not None else _seconds(times)
        what = describe(src)
        if not threading.current_thread().name.startswith(PRECOMPILE_THREADS):
            self.since_mark.append(what)  # compiled at its first launch, not ahead
        if self.is_ready:
            self.late.append(what)
            log.warning("Triton compiled %s on the request path (%d so far)", what, len(self.late))

    def ready(self) -> None:
        """Start-up is over: say what it compiled and loaded, and log later compilations."""
        self.is_ready = True
        log.info(
            "Triton kernels at start-up: %d compiled (%.1f s), %d loaded from %s",
            self.compiled,
            self.compile_s,
            self.loaded,
            os.environ.get("TRITON_CACHE_DIR", "Triton's default cache"),
        )
        if self.since_mark:
            # Variants the start-up compile did not reach ahead (compiled one by one, later).
            log.info("Triton compiled after the start-up compile: %s", "; ".join(self.since_mark))


_installed: CompileLog | None = None


def install() -> CompileLog:
    """The process's CompileLog, listening to Triton's compilations from now on (idempotent)."""
    global _installed
    if _installed is None:
        from triton import knobs

        _installed = CompileLog()
        knobs.compilation.listener = _installed
    return _installed
