"""A checkpoint's weight files: which they are, and reading them into the page cache ahead of
the load (no torch here: the engine process starts the read-ahead before it imports torch).

On a machine whose disk has not seen the checkpoint, the load phase is the disk's time (16 GB
of an 8B model: ~8.5 s at the ~2 GB/s of an H200 host's disk), while the 4-5 s before it (the
process's start and its imports of torch and Triton) are CPU-bound and leave the disk idle.
`read_ahead` fills that idle time: one thread asks the kernel to read the shards in the
loader's order, one 16 MiB piece at a time (`posix_fadvise(WILLNEED)`, then a read of the piece's
last byte to wait for it: one piece queued, so the imports' own reads of libraries do not wait
behind gigabytes of read-ahead; nothing is copied out, so pages already cached cost nothing), and
stops at half the memory the kernel reports available (a model larger than that would only
evict its own first shards). Where there is no `posix_fadvise` each piece is read outright.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PIECE_BYTES = 16 << 20


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: the sharded index's, else model.safetensors, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards named in {index.name} are missing: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {str(model_dir)!r}")
    return files


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class ReadAhead:
    """A read-ahead in progress (its thread) and what it has done so far."""

    total: int  # the bytes it means to read (the checkpoint's, or the memory cap)
    read: int = 0
    seconds: float = 0.0
    error: str | None = None
    thread: threading.Thread | None = field(default=None, repr=False)
    stop: threading.Event = field(default_factory=threading.Event, repr=False)

    def summary(self) -> str:
        done = "done" if self.thread is None or not self.thread.is_alive() else "still reading"
        scale, unit = (1e9, "GB") if self.total >= 1e9 else (1e6, "MB")
        text = (
            f"{self.read / scale:.1f} of {self.total / scale:.1f} {unit} in {self.seconds:.1f} s, "
            f"{done}"
        )
        return text + (f" (stopped: {self.error})" if self.error else "")


def read_ahead(
    model_dir: str | Path, limit: int | None = None, piece: int = PIECE_BYTES
) -> ReadAhead | None:
    """Start reading the checkpoint's shards into the page cache on a daemon thread; None when
    the directory has no safetensors checkpoint (the loader reports that) or nothing to read.
    `limit`: the most bytes to read (default: half of the available memory)."""
    try:
        files = safetensors_files(Path(model_dir))
    except (OSError, ValueError):
        return None
    sizes = [(f, f.stat().st_size) for f in files]
    if limit is None:
        avail = available_memory()
        limit = avail // 2 if avail is not None else 0
    total = min(sum(s for _, s in sizes), max(0, limit))
    if total == 0:
        return None
    state = ReadAhead(total)

    advise = getattr(os, "posix_fadvise", None)

    def run() -> None:
        t0 = time.perf_counter()
        buf = memoryview(bytearray(1 if advise else piece))
        try:
            for f, size in sizes:
                fd = os.open(f, os.O_RDONLY)
                try:
                    off = 0
                    while off < size and state.read < total and not state.stop.is_set():
                        n = min(piece, total - state.read, size - off)
                        if advise is not None:
                            advise(fd, off, n, os.POSIX_FADV_WILLNEED)
                            got = n if os.preadv(fd, [buf], off + n - 1) else 0
                        else:
                            got = os.preadv(fd, [buf[:n]], off)
                        if got == 0:
                            break
                        off += got
                        state.read += got
                        state.seconds = time.perf_counter() - t0
                finally:
                    os.close(fd)
                if state.read >= total or state.stop.is_set():
                    break
        except OSError as e:  # only a hint: the loader reads the files again and reports
            state.error = str(e)
        state.seconds = time.perf_counter() - t0

    state.thread = threading.Thread(target=run, name="weights-read-ahead", daemon=True)
    state.thread.start()
    return state


_started: ReadAhead | None = None


def start_read_ahead(model_dir: str | Path) -> ReadAhead | None:
    """`read_ahead` for this process's engine, kept for the load to report (`started`)."""
    global _started
    _started = read_ahead(model_dir)
    return _started


def started() -> ReadAhead | None:
    """This process's read-ahead, if one was started."""
    return _started
