"""A fresh machine's first `import torch`: what the engine core pays before its first phase when
the page cache holds none of torch's libraries, and whether reading them ahead on threads beside
the import shortens it (it did not: on an H200 host it made the import 2-3 s slower, so ember does
not do it; docs/performance.md).

Each run evicts the libraries from the page cache (posix_fadvise DONTNEED: clean pages of files
no process maps, no root needed), then times a new process's `import torch`, `import triton` and
CUDA's set-up, with and without the read-ahead ("preload"), alternating. A warm row (nothing evicted) is the
floor. The files' cold read rate is measured too (one thread and eight).

    python benchmarks/cold_import.py [--reps 2]

Prints a table and writes
benchmarks/results/cold_import-<GPU>-<date>.json (or $OUT/ when set).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from result_names import result_path

ROOT = Path(__file__).resolve().parents[1]
THREADS = 8
CHUNK = 4 << 20


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def library_files() -> list[Path]:
    """The shared libraries `import torch`, `import triton` and CUDA's set-up map: torch's own,
    the NVIDIA wheels' (cuBLAS, cuDNN, NCCL, ...; beside torch in site-packages) and Triton's,
    largest first."""
    files: set[Path] = set()
    torch_dir = _package_dir("torch")
    if torch_dir is not None:
        files.update(torch_dir.glob("lib/*.so*"))
        files.update(torch_dir.glob("*.so"))
        files.update(torch_dir.parent.glob("nvidia/*/lib/*.so*"))
        files.update(torch_dir.parent.glob("nvidia/*/*/lib/*.so*"))  # nvidia/cu13/lib layouts
    triton_dir = _package_dir("triton")
    if triton_dir is not None:
        files.update(triton_dir.glob("_C/*.so*"))
        files.update(triton_dir.glob("backends/nvidia/lib/*.so*"))
    sized = []
    for f in files:
        try:
            if f.is_file():
                sized.append((f.stat().st_size, f))
        except OSError:
            continue
    return [f for _, f in sorted(sized, key=lambda x: (-x[0], str(x[1])))]


def module_files() -> list[Path]:
    """The compiled Python modules (`__pycache__/*.<tag>.pyc`) of torch and Triton: thousands of
    small files `import torch` opens one after another."""
    tag = sys.implementation.cache_tag
    files: list[Path] = []
    for name in ("torch", "triton"):
        pkg = _package_dir(name)
        if pkg is not None:
            files.extend(pkg.rglob(f"__pycache__/*.{tag}.pyc"))
    return files


def _read(path: Path, buf: bytearray) -> int:
    n = 0
    try:
        with open(path, "rb", buffering=0) as fh:
            view = memoryview(buf)
            while got := fh.readinto(view):
                n += got
    except OSError:
        pass
    return n


def _read_all(files: list[Path], threads: int) -> None:
    local = threading.local()

    def read(path: Path) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(CHUNK)
        return _read(path, buf)

    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="ember-preload") as pool:
            total = sum(pool.map(read, files))
        del total
    except Exception:  # noqa: BLE001 - only a head start: the loader reads what it needs itself
        pass


CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
if sys.argv[1] == "preload":
    import threading
    sys.path.insert(0, sys.argv[2])
    from cold_import import THREADS, _read_all, library_files, module_files
    threading.Thread(target=lambda: _read_all(library_files() + module_files(), THREADS),
                     daemon=True).start()
t1 = time.perf_counter()
import torch
t2 = time.perf_counter()
import triton
t3 = time.perf_counter()
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.init()
    torch.zeros(1, device="cuda")
t4 = time.perf_counter()
maps = sorted({line.split()[-1] for line in open("/proc/self/maps") if ".so" in line})
print(json.dumps({"start_preload_s": t1 - t0, "torch_s": t2 - t1, "triton_s": t3 - t2,
                  "cuda_s": t4 - t3, "total_s": t4 - t0, "cuda": cuda, "maps": maps}))
"""


def evict(files: list[Path]) -> int:
    """Drops `files` from the page cache (written back first: dirty pages would stay), skipping
    any that cannot be opened; returns the bytes evicted."""
    total = 0
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            # Some mounts refuse fsync on a read-only descriptor (EINVAL, seen on an H200 host's
            # library files); such a file has no dirty pages of ours to write back.
            with contextlib.suppress(OSError):
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def read_all(files: list[Path], threads: int) -> float:
    def read(f: Path) -> int:
        with open(f, "rb", buffering=0) as fh:
            n = 0
            while chunk := fh.read(8 << 20):
                n += len(chunk)
            return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, files))
    return total / (time.perf_counter() - t0)


def child(mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    files = library_files()
    size = sum(f.stat().st_size for f in files)
    modules = module_files()
    # Cold means every file of the packages: their libraries, modules and data.
    everything = [
        f for d in {f.parent for f in modules} | {f.parent for f in files} for f in d.glob("*")
    ]
    everything += [p for d in {m.parent.parent for m in modules} for p in d.glob("*.py")]
    warm = child("none")
    mapped = [Path(p) for p in warm.pop("maps")]
    evict(files)
    cold1 = read_all(files, 1)
    evict(files)
    cold8 = read_all(files, 8)
    rows: list[dict] = [{"mode": "warm", **warm}]
    for rep in range(args.reps):
        for mode in ("none", "preload") if rep % 2 == 0 else ("preload", "none"):
            evict(files)
            evict(mapped)
            evict(everything)
            r = child(mode)
            r.pop("maps")
            rows.append({"mode": f"cold, {mode}", "rep": rep, **r})
    in_list = {str(f) for f in files}
    missed = [str(p) for p in mapped if str(p) not in in_list and "site-packages" in str(p)]
    print(
        f"{len(files)} library files, {size / 1e9:.2f} GB, {len(modules)} compiled modules; cold read {cold1 / 1e9:.2f} GB/s on "
        f"one thread, {cold8 / 1e9:.2f} GB/s on eight; mapped after import but not preloaded: "
        f"{len(missed)}"
    )
    print("| run | preload started | import torch | import triton | CUDA set-up | total |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['start_preload_s']:.2f} s | {r['torch_s']:.2f} s | "
            f"{r['triton_s']:.2f} s | {r['cuda_s']:.2f} s | {r['total_s']:.2f} s |"
        )
    machine = os.environ.get("EMBER_MACHINE") or os.uname().nodename
    try:
        import torch

        if torch.cuda.is_available():
            machine = torch.cuda.get_device_name().replace(" ", "_")
    except ImportError:
        pass
    out_dir = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
    out = result_path(
        "cold_import", machine if machine != os.uname().nodename else "cpu", out_dir=out_dir
    )
    out.write_text(
        json.dumps(
            {
                "files": len(files),
                "bytes": size,
                "cold_read_1_thread_bytes_per_s": cold1,
                "cold_read_8_threads_bytes_per_s": cold8,
                "mapped_not_preloaded": missed,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
