"""Where Triton keeps its compiled kernels, and a count of what it compiles and when.

Triton compiles a kernel variant (a kernel at one set of constexprs and argument
specializations) the first time a launch needs it, and keeps the binary in its cache, keyed by
the kernel's source, the GPU's architecture, Triton's version and the options. ember points that
cache into its home ($EMBER_HOME/triton, ~/.cache/ember/triton) unless TRITON_CACHE_DIR is set, so
a second start on the same machine loads what the first compiled.

`CompileLog` listens to every compilation (`triton.knobs.compilation.listener`): how many variants
were compiled and how many came from the cache, and, once the engine says it is ready, each
variant still compiled later, on the request path, is logged by name: those are the ones a
start-up warm-up should reach.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ember.home import ember_home

log = logging.getLogger(__name__)


def use_ember_cache() -> str:
    """Point Triton's cache into ember's home unless the user chose one; returns the directory.
    Set in the environment, so the engine-core processes started after this inherit it."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(ember_home() / "triton")
    return os.environ["TRITON_CACHE_DIR"]


@dataclass
class CompileLog:
    compiled: int = 0
    """Variants compiled (cache misses) since install."""
    loaded: int = 0
    """Variants loaded from the on-disk cache."""
    late: list[str] = field(default_factory=list)
    """Kernel names compiled after `ready()` (on the request path)."""
    is_ready: bool = False

    def __call__(
        self,
        *,
        src: Any,
        metadata: dict[str, Any],
        metadata_group: dict[str, str],
        times: Any,
        cache_hit: bool,
    ) -> None:
        if cache_hit:
            self.loaded += 1
            return
        self.compiled += 1
        if self.is_ready:
            name = getattr(src, "name", "?")
            self.late.append(name)
            log.warning("Triton compiled %s on the request path (%d so far)", name, len(self.late))

    def ready(self) -> None:
        """Start-up is over: say what it compiled and loaded, and log later compilations."""
        self.is_ready = True
        log.info(
            "Triton kernels at start-up: %d compiled, %d loaded from %s",
            self.compiled,
            self.loaded,
            os.environ.get("TRITON_CACHE_DIR", "Triton's default cache"),
        )


_installed: CompileLog | None = None


def install() -> CompileLog:
    """The process's CompileLog, listening to Triton's compilations from now on (idempotent)."""
    global _installed
    if _installed is None:
        from triton import knobs

        _installed = CompileLog()
        knobs.compilation.listener = _installed
    return _installed
