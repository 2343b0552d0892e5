"""The CUDA driver's set-up of the engine's GPU, done ahead on a thread while the engine process
imports torch.

A new process's first CUDA call pays the driver's initialization and the device's primary
context on the start-up's critical path: 0.31-0.34 s on an H200 host after `import torch`
(`torch.cuda.set_device` and `mem_get_info` timed in a fresh process, docs/performance.md). The driver's calls release the GIL (ctypes lets it go), so a thread makes
them here (`cuInit`, then the device's primary context retained) beside the imports; torch's
runtime uses the device's primary context, so it finds it made: 0.02 s of set-up were left after
the import in the same probe. The reference is kept for the process's life, as torch's own is.

Only for the engine process `ember serve` spawns (ember/engine/core_spawn.py), which makes its
GPU's context anyway; whatever fails here (no driver, no such device) is left for torch to meet
and report as before. Nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import os
import threading

_thread: threading.Thread | None = None
_context = ctypes.c_void_p()  # the retained primary context (kept: torch uses the same one)


def device_ordinal(device: str) -> int | None:
    """The CUDA device `device` names ("cuda" is the first visible one), None if not CUDA."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return None
    try:
        return int(index) if index else 0
    except ValueError:
        return None  # (the engine's config says what is wrong with it)


def _retain(ordinal: int) -> None:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return  # no driver here: torch says so in its own words
    dev = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        return
    cuda.cuDevicePrimaryCtxRetain(ctypes.byref(_context), dev)


def start(device: str) -> None:
    """Begin the set-up of `device`'s context on a daemon thread (once a process; nothing for a
    device that is not CUDA)."""
    global _thread
    ordinal = device_ordinal(device)
    if _thread is not None or ordinal is None:
        return
    # Read by the driver at cuInit: the value torch would set before its own first CUDA call.
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    _thread = threading.Thread(target=_retain, args=(ordinal,), name="cuda-context", daemon=True)
    _thread.start()


def wait() -> None:
    """Until the set-up `start` began is done (at once if never started)."""
    if _thread is not None:
        _thread.join()
