"""What the host tier's pinning costs an engine's start-up work beside it: a start whose tier
grew during start-up reached ready 2.8-5.5 s after one without a tier (H200, 8B shape), its
weights loading in 5.0 against 1.6 s and its dry run in 5.0 against 1.9 s. Each kind of
start-up work is timed alone, beside the tier's growth (4 fault threads, then 1; huge pages;
kept from forks; 64 MiB chunks, as `ember/kv/tiers/host_memory.py` grows it) and with 4 GiB
pinned and held, marked MADV_DONTFORK as the tier's now is, or not:

- h2d: copies from a pinned staging buffer to the GPU, as the weight loader does (GB/s);
- compile: a fresh Triton kernel compiled (s);
- fork: a child forked and reaped (ms; Linux copies a process's pinned anonymous pages into
  the child at the fork, unless they are marked MADV_DONTFORK);
- faults: 1 GiB of fresh pageable memory touched by the main thread (s; the process's memory
  map is shared with the faulting threads);
- cuda_alloc: `torch.empty` of 1 GiB on the GPU and its release, uncached (ms).

    python benchmarks/probes/pinning_beside_start.py [--gib 16]

Prints a table and writes pinning_beside_start-<GPU>-<date>.json to $OUT (or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_names import result_path  # noqa: E402

from ember.host_pages import advise_huge_pages, keep_from_forks  # noqa: E402
from ember.kv.tiers.host_memory import (  # noqa: E402
    _host_register,
    _host_unregister,
    _touch,
)

KERNEL = """
import triton
import triton.language as tl

@triton.jit
def k(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + i, mask=i < n)
    tl.store(y + i, tl.exp(v) * {c} + tl.sin(v), mask=i < n)
"""
_compiles = 0


def h2d(gib: int = 4) -> float:
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(gib * 4):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return gib * (1 << 30) / (time.perf_counter() - t) / 1e9


def compile_once() -> float:
    global _compiles
    _compiles += 1
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"probe_kernel_{_compiles}.py"
        path.write_text(KERNEL.format(c=float(_compiles)))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        x = torch.randn(4096, device="cuda")
        t = time.perf_counter()
        mod.k[(4,)](x, torch.empty_like(x), 4096, BLOCK=1024)
        torch.cuda.synchronize()
        return time.perf_counter() - t


def fork() -> float:
    """A child forked and reaped, as the engine forks its Triton compile workers (ms)."""
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return (time.perf_counter() - t) * 1e3


def faults() -> float:
    t = time.perf_counter()
    x = torch.empty(1 << 30, dtype=torch.uint8)
    _touch(x, 1)
    del x
    return time.perf_counter() - t


def cuda_alloc() -> float:
    torch.cuda.empty_cache()
    t = time.perf_counter()
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    del x
    torch.cuda.empty_cache()
    return (time.perf_counter() - t) * 1e3


WORK: dict[str, tuple[Callable[[], float], str]] = {
    "h2d": (h2d, "GB/s"),
    "compile": (compile_once, "s"),
    "fork": (fork, "ms"),
    "faults": (faults, "s"),
    "cuda_alloc": (cuda_alloc, "ms"),
}


def grow(
    total: int, threads: int, chunks: list[torch.Tensor], stop: threading.Event, no_fork: bool
) -> None:
    for _ in range(total // (64 << 20)):
        if stop.is_set():
            return
        t = torch.empty(64 << 20, dtype=torch.uint8)
        advise_huge_pages(t)
        if no_fork:
            keep_from_forks(t)
        _touch(t, threads)
        _host_register(t)
        chunks.append(t)


def measure(fn: Callable[[], float], repeats: int = 3) -> float:
    return statistics.median(fn() for _ in range(repeats))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=int, default=16)
    args = p.parse_args()
    torch.cuda.init()
    for fn, _ in WORK.values():
        fn()  # first-call costs (CUDA context, Triton's imports) out of the way
    rows = []
    conditions = (
        "alone",
        "beside growth, 4 threads",
        "beside growth, 1 thread",
        "4 GiB pinned held",
        "4 GiB pinned held, kept from forks",
    )
    for cond in conditions:
        row: dict = {"condition": cond}
        for name, (fn, unit) in WORK.items():
            chunks: list[torch.Tensor] = []
            stop = threading.Event()
            thread = None
            if cond.startswith("beside"):
                threads = 4 if "4" in cond else 1
                thread = threading.Thread(
                    target=grow, args=(args.gib << 30, threads, chunks, stop, True)
                )
                thread.start()
                time.sleep(0.2)
            elif "held" in cond:
                grow(4 << 30, 4, chunks, stop, no_fork="kept" in cond)
            row[name] = measure(fn)
            row[f"{name}_unit"] = unit
            if thread is not None:
                row[f"{name}_growth_alive"] = thread.is_alive()
                stop.set()
                thread.join()
            for c in chunks:
                _host_unregister(c)
            chunks.clear()
        rows.append(row)
        print(f"{cond:28s} " + "  ".join(f"{n} {row[n]:.3g} {u}" for n, (_, u) in WORK.items()))
    gpu = torch.cuda.get_device_name()
    dest = result_path("pinning_beside_start", gpu)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"gpu": gpu, "gib": args.gib, "rows": rows}, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
