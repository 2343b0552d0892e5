"""A new process's CUDA set-up after `import torch`, with and without the device's primary context
retained through the driver on a thread beside the import (what ember/engine/cuda_context.py does
in the spawned core; this probe has the same three driver calls of its own). One process a run:
`python benchmarks/cuda_context_probe.py plain|ahead` prints one line; session 20's call 1 ran
`plain` and `ahead` alternately three times each (results/cuda_context_probe-H200-2026-11-28.txt).
A probe as it was run, not a table-and-JSON benchmark."""

import ctypes
import sys
import threading
import time

t0 = time.perf_counter()
ahead = sys.argv[1] == "ahead"
th = None
if ahead:

    def init() -> None:
        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuInit(0)
        dev = ctypes.c_int()
        cu.cuDeviceGet(ctypes.byref(dev), 0)
        ctx = ctypes.c_void_p()
        cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)

    th = threading.Thread(target=init)
    th.start()
import torch  # noqa: E402

t1 = time.perf_counter()
if th is not None:
    th.join()
t2 = time.perf_counter()
torch.cuda.set_device(0)
torch.cuda.mem_get_info(0)
t3 = time.perf_counter()
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
t4 = time.perf_counter()
print(
    f"{sys.argv[1]}: import {t1 - t0:.2f} s, join {t2 - t1:.2f} s, cuda set-up {t3 - t2:.2f} s, "
    f"first GiB {t4 - t3:.2f} s, total {t4 - t0:.2f} s"
)
