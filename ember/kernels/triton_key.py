"""Triton's key for its own install, computed ahead on a thread of its own.

Every variant's on-disk cache key includes `triton.runtime.cache.triton_key()`: a hash of
Triton's compiler sources and of libtriton (~400 MB, read in 1 MB chunks). The first variant to
ask computes it, ~0.9 s on an H200 host (cProfile of a fresh start: 0.53 s of reads, 0.34 s of
hashing), on the asking thread: the start-up dry run's, which then met every later variant
~0.9 s late (the compile of the last of them is the start-up compile's critical path), and a
compile worker forked before it had the key computed it again. Reading and hashing release the
GIL, so here it runs beside the engine process's imports (torch, 3-5 s on those hosts) and its
CUDA set-up and load; `wait()` before the first compile.
"""

from __future__ import annotations

import threading

_thread: threading.Thread | None = None


def _compute() -> None:
    try:
        from triton.runtime.cache import triton_key

        triton_key()  # lru_cached: later callers find it
    except Exception:  # noqa: BLE001 - only a head start: the first compile computes it otherwise
        pass


def start() -> None:
    """Begin computing the key on a daemon thread (once a process)."""
    global _thread
    if _thread is None:
        _thread = threading.Thread(target=_compute, name="triton-key", daemon=True)
        _thread.start()


def wait() -> None:
    """Until the key computed by `start` is ready (at once if never started)."""
    if _thread is not None:
        _thread.join()
