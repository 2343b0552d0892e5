"""Triton's one-time set-up of a process, done ahead on a thread of its own: its install key and
its CUDA utilities.

Every variant's on-disk cache key includes `triton.runtime.cache.triton_key()`: a hash of
Triton's compiler sources and of libtriton (~400 MB, read in 1 MB chunks). The first variant to
ask computes it, ~0.9 s on an H200 host (cProfile of a fresh start: 0.53 s of reads, 0.34 s of
hashing), on the asking thread: the start-up dry run's, which then met every later variant
~0.9 s late (the compile of the last of them is the start-up compile's critical path), and a
compile worker forked before it had the key computed it again. Reading and hashing release the
GIL, so here it runs beside the engine process's imports (torch, 3-5 s on those hosts) and its
CUDA set-up; `wait()` before anything uses Triton.

The same thread then builds Triton's CUDA utilities (`cuda_utils.c`, compiled with the system's
compiler into Triton's cache on a fresh machine, then loaded), which the first use of
`triton.runtime.driver.active` needs: on a fresh H200 start the dry run met its first variant
0.86 s in against 0.19 s warm, after the install key had moved here. (That build is not
measured on its own: its move here was not yet run on a GPU.) It touches no CUDA device, so no
context is made on a GPU the engine does not use. Triton's cache directory is ember's
(`compile_log.use_ember_cache`) before anything is built.
"""

from __future__ import annotations

import threading

_thread: threading.Thread | None = None


def _compute() -> None:
    # Only a head start: whatever fails here, the first compile does itself, as without it.
    try:
        from triton.runtime.cache import triton_key

        triton_key()  # lru_cached: later callers find it
    except Exception:  # noqa: BLE001
        return
    try:
        from triton.backends.nvidia.driver import CudaUtils

        CudaUtils()  # builds (or finds) and loads cuda_utils; the driver's own finds it cached
    except Exception:  # noqa: BLE001 - no NVIDIA backend, no libcuda (a CPU machine)
        pass


def start() -> None:
    """Begin the set-up on a daemon thread (once a process)."""
    global _thread
    if _thread is None:
        from ember.kernels.compile_log import use_ember_cache

        use_ember_cache()
        _thread = threading.Thread(target=_compute, name="triton-setup", daemon=True)
        _thread.start()


def wait() -> None:
    """Until the set-up `start` began is done (at once if never started)."""
    if _thread is not None:
        _thread.join()
