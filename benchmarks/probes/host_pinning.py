"""How fast host memory can be pinned for the KV host tier, and what it costs a GPU's steps beside
it: plain pages faulted by one thread (the tier's way so far) or several, with or without
transparent huge pages (madvise), then cudaHostRegister through ctypes; in chunks of 64 MiB
and 1 GiB. Each way pins the same total while the main thread runs tiny GPU steps (a small
matmul, a 2 MiB host copy, a sync), whose times are the cost; torch's pin_memory=True is the
baseline.

    python benchmarks/probes/host_pinning.py [--gib 8]

Prints a table and writes host_pinning-<GPU>-<date>.json to $OUT (or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_names import result_path  # noqa: E402

from ember.host_pages import advise_huge_pages  # noqa: E402
from ember.kv.tiers.host_memory import (  # noqa: E402
    _cudart,
    _host_register,
    _host_unregister,
    _touch,
)


def fault(t: torch.Tensor, threads: int, huge: bool) -> None:
    """Touch every page of `t` as the host tier does (its `_touch`, after `advise_huge_pages`
    when `huge`)."""
    if huge:
        advise_huge_pages(t)
    _touch(t, threads)


def pin_all(
    total: int, chunk: int, threads: int, huge: bool, torch_pin: bool
) -> tuple[float, list[torch.Tensor]]:
    chunks = []
    t0 = time.perf_counter()
    for _ in range(total // chunk):
        if torch_pin:
            chunks.append(torch.empty(chunk, dtype=torch.uint8, pin_memory=True))
            continue
        t = torch.empty(chunk, dtype=torch.uint8)
        fault(t, threads, huge)
        _host_register(t)
        chunks.append(t)
    return time.perf_counter() - t0, chunks


def steps_beside(work: threading.Thread) -> list[float]:
    """Tiny GPU steps (ms each) while `work` runs."""
    a = torch.randn(256, 256, device="cuda")
    src = torch.empty(1 << 21, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 21, dtype=torch.uint8, device="cuda")
    times = []
    work.start()
    while work.is_alive():
        t = time.perf_counter()
        a @ a
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    work.join()
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=int, default=8)
    args = p.parse_args()
    total = args.gib << 30
    assert _cudart() is not None, "the CUDA runtime is not loaded through ctypes"
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    thp_mode = thp.read_text().strip() if thp.exists() else "absent"
    ways = [
        ("torch pin_memory, 64 MiB", 64 << 20, 1, False, True),
        ("1 thread, 64 MiB", 64 << 20, 1, False, False),
        ("1 thread, huge pages, 64 MiB", 64 << 20, 1, True, False),
        ("4 threads, 64 MiB", 64 << 20, 4, False, False),
        ("4 threads, huge pages, 64 MiB", 64 << 20, 4, True, False),
        ("8 threads, huge pages, 64 MiB", 64 << 20, 8, True, False),
        ("8 threads, huge pages, 1 GiB", 1 << 30, 8, True, False),
    ]
    torch.cuda.init()
    base = steps_beside(threading.Thread(target=time.sleep, args=(1.0,)))
    rows = [
        {
            "way": "no pinning (steps alone)",
            "steps_p50_ms": statistics.median(base),
            "steps_p99_ms": sorted(base)[int(0.99 * len(base))],
            "steps_max_ms": max(base),
        }
    ]
    print(f"THP: {thp_mode}; steps alone p50 {rows[0]['steps_p50_ms']:.3f} ms")
    for name, chunk, threads, huge, torch_pin in ways:
        out: dict = {}

        def work(out=out, chunk=chunk, threads=threads, huge=huge, torch_pin=torch_pin) -> None:
            out["s"], out["chunks"] = pin_all(total, chunk, threads, huge, torch_pin)

        steps = steps_beside(threading.Thread(target=work))
        if not torch_pin:
            for c in out["chunks"]:
                _host_unregister(c)
        out["chunks"].clear()
        row = {
            "way": name,
            "gib": args.gib,
            "s": out["s"],
            "s_per_gib": out["s"] / args.gib,
            "steps_p50_ms": statistics.median(steps),
            "steps_p99_ms": sorted(steps)[int(0.99 * len(steps))],
            "steps_max_ms": max(steps),
        }
        rows.append(row)
        print(
            f"{name:32s} {row['s_per_gib']:.3f} s/GiB; steps p50 {row['steps_p50_ms']:.3f} "
            f"p99 {row['steps_p99_ms']:.2f} max {row['steps_max_ms']:.1f} ms"
        )
    gpu = torch.cuda.get_device_name()
    dest = result_path("host_pinning", gpu)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"gpu": gpu, "thp": thp_mode, "rows": rows}, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
