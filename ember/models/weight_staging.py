"""Safetensors shards onto the GPU through pinned staging buffers, read by several threads.

`safe_open(...).get_tensor` reads each tensor into pageable host memory on the loading thread,
and the copy into a GPU parameter then goes through the driver's own staging: two host copies a
byte on one thread, ~6 GB/s for an 8B checkpoint in the page cache (2.5-3 s of every start on an
H200). Here reader threads `preadv` byte ranges of the file (a chunk of whole tensors, or a
piece of one larger than a buffer) straight into pinned buffers, each piece goes to the GPU in
one asynchronous copy, and the tensors are yielded as views of their chunk's GPU memory. The
safetensors library has no call that reads into a buffer we give it, so the format's header (a
little-endian u64 length, then JSON: name -> dtype, shape, data_offsets) is parsed here; a file
with a dtype not listed below goes through `safe_open` instead.

A chunk's GPU memory is its own allocation (never reused while a view of it lives: the FP8
dequantizer holds tensors until their scales arrive), freed when its last view is gone.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ember.host_pages import keep_from_forks

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

CHUNK_BYTES = 64 << 20
"""A chunk's tensors go to the GPU together; also each staging buffer's size (8 readers and 10
pinned buffers: 640 MiB of host memory while the weights load)."""
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offsets in the file (the header's, plus the data section's start)
    end: int


@dataclass(frozen=True)
class Chunk:
    start: int
    end: int
    entries: tuple[Entry, ...]

    def pieces(self, size: int) -> list[tuple[int, int]]:
        """The byte ranges of at most `size` it is read in (one unless a tensor is larger)."""
        return [(lo, min(lo + size, self.end)) for lo in range(self.start, self.end, size)]


def read_header(path: Path) -> list[Entry] | None:
    """The file's tensors in file order; None if one has a dtype not in DTYPES. Raises
    ValueError on a malformed header (lengths or offsets outside the file, sizes that do not
    match their shapes)."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: header length {n} beyond the file ({size} bytes)")
        try:
            header = json.loads(fh.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    base, entries = 8 + n, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a malformed entry") from None
        dtype = DTYPES.get(dtype_name)
        if dtype is None:
            return None
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{path}: tensor {name!r} has shape {shape!r}")
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        if not (isinstance(begin, int) and isinstance(end, int)):
            raise ValueError(f"{path}: tensor {name!r} has offsets {[begin, end]!r}")
        if not 0 <= begin <= end <= size - base or end - begin != nbytes:
            raise ValueError(
                f"{path}: tensor {name!r} ({dtype_name} {shape}) has bytes [{begin}, {end}) "
                f"of a {size - base}-byte data section"
            )
        entries.append(Entry(name, dtype, tuple(shape), base + begin, base + end))
    entries.sort(key=lambda e: e.start)
    return entries


def plan_chunks(entries: list[Entry], chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """Runs of tensors that lie next to each other in the file, each up to `chunk_bytes` (a
    tensor larger than that is a chunk alone)."""
    chunks: list[Chunk] = []
    run: list[Entry] = []
    for e in entries:
        if run and (e.start != run[-1].end or e.end - run[0].start > chunk_bytes):
            chunks.append(Chunk(run[0].start, run[-1].end, tuple(run)))
            run = []
        run.append(e)
    if run:
        chunks.append(Chunk(run[0].start, run[-1].end, tuple(run)))
    return chunks


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise ValueError(f"file ended {len(view) - done} bytes early at offset {offset + done}")
        done += got


class _Buffers:
    """Host staging buffers (pinned on CUDA): a reader takes one, the loading thread gives it
    back once the GPU copy from it has finished. Taken in the pieces' order: were a later piece
    to take the last free buffer while an earlier one waits, the loading thread (which needs the
    earlier one first) would never give one back."""

    def __init__(self, count: int, size: int, pin: bool) -> None:
        self._free = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(count)]
        if pin:
            for buf in self._free:  # pinned: a forked compile worker would copy it
                keep_from_forks(buf)
        self._ready = threading.Condition()
        self._next = 0  # the piece whose turn it is to take a buffer
        self._closed = False

    def take(self, piece: int) -> torch.Tensor:
        with self._ready:
            self._ready.wait_for(lambda: (self._free and self._next == piece) or self._closed)
            if self._closed:
                raise RuntimeError("the weights' reading stopped")
            self._next += 1
            self._ready.notify_all()
            return self._free.pop()

    def close(self) -> None:
        """Wakes the readers still waiting for a buffer (the load stopped early)."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def drop(self) -> None:
        """Lets go of the free buffers (after `close`, the readers done)."""
        with self._ready:
            self._free.clear()

    def give(self, buf: torch.Tensor) -> None:
        with self._ready:
            self._free.append(buf)
            self._ready.notify_all()


def iter_staged(
    files: list[Path],
    device: torch.device | str,
    threads: int = 8,
    chunk_bytes: int = CHUNK_BYTES,
    nice: int = 0,
    release: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on `device`) for every tensor of `files`, in file order. A file whose
    header names a dtype not in DTYPES is read through `safe_open` instead. `nice`: the
    readers' nice value, for a load that runs beside other start-up work (the kernel's copies
    out of the page cache are CPU time: 16 GB is ~8 cores for most of a second). `release`:
    hand the staging memory back at the end (`release_cached`); a load on a thread beside a
    graph capture leaves that to the thread that waits for it."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    plans = [(f, read_header(f)) for f in files]
    chunks = {fi: plan_chunks(e, chunk_bytes) for fi, (_, e) in enumerate(plans) if e is not None}
    pieces = [
        (fi, lo, hi) for fi, cs in chunks.items() for c in cs for lo, hi in c.pieces(chunk_bytes)
    ]
    # Each reader holds one buffer while it reads; two more let the copies run behind them.
    threads = max(1, min(threads, len(pieces)))
    largest = max((hi - lo for _, lo, hi in pieces), default=0)
    buffers = _Buffers(min(threads + 2, len(pieces)), largest, pin=cuda)
    fds = {fi: os.open(plans[fi][0], os.O_RDONLY) for fi in chunks}

    def read(piece: int, fi: int, lo: int, hi: int) -> torch.Tensor:
        buf = buffers.take(piece)
        try:
            _pread_into(fds[fi], memoryview(buf.numpy())[: hi - lo], lo)
        except BaseException:
            buffers.give(buf)
            raise
        return buf

    pool = ThreadPoolExecutor(
        threads, thread_name_prefix="weights-read", initializer=_renice, initargs=(nice,)
    )
    futures: list[Future[torch.Tensor]] = []
    buf: torch.Tensor | None = None
    try:
        # Submitted in order; a reader waits in `take` until the loading thread gives a buffer
        # back, so no more pieces than buffers are read ahead.
        futures += [pool.submit(read, n, *piece) for n, piece in enumerate(pieces)]
        jobs = iter(futures)
        for fi, (f, _) in enumerate(plans):
            if fi not in chunks:
                yield from iter_safetensors([f], device)
                continue
            for chunk in chunks[fi]:
                gpu = torch.empty(chunk.end - chunk.start, dtype=torch.uint8, device=device)
                for lo, hi in chunk.pieces(chunk_bytes):
                    buf = next(jobs).result()
                    gpu[lo - chunk.start : hi - chunk.start].copy_(
                        buf[: hi - lo], non_blocking=cuda
                    )
                    if cuda:
                        # The buffer is free once its copy has run (the copies into parameters
                        # queued before it on the same stream are short).
                        torch.cuda.current_stream(device).synchronize()
                    buffers.give(buf)
                for e in chunk.entries:
                    yield e.name, _view(gpu, e.start - chunk.start, e)
    finally:
        buffers.close()
        pool.shutdown(wait=True, cancel_futures=True)
        for fd in fds.values():
            os.close(fd)
        futures.clear()  # (a finished future holds its buffer)
        buf = None
        buffers.drop()
        if release:
            release_cached(cuda)


def _renice(nice: int) -> None:
    """This thread's nice value raised by `nice` (Linux schedules threads as tasks of their
    own; elsewhere, or where it is refused, nothing changes: it only yields CPU time)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except OSError:
        pass


def release_cached(cuda: bool) -> None:
    """Called once no staging buffer is referenced, and not while another thread captures a
    CUDA graph (the frees synchronize the device). On CUDA the chunks' memory goes back to the
    device (the KV cache is sized from what the driver reports free after the load) and the
    pinned buffers to the host: torch caches freed pinned memory for the process's life (640 MiB
    locked). `_host_emptyCache` is private API (torch.cuda.graphs calls it too)."""
    if not cuda:
        return
    torch.cuda.empty_cache()
    release_host = getattr(torch._C, "_host_emptyCache", None)
    if release_host is not None:
        release_host()


def iter_safetensors(
    files: list[Path], device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `files` through the safetensors library's own reads (off the GPU, and
    for a file `iter_staged` cannot parse)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, fh.get_tensor(name)


def _view(chunk: torch.Tensor, offset: int, e: Entry) -> torch.Tensor:
    """The entry's tensor as a view of its chunk's bytes (a copy where its offset is not a
    multiple of its element size, which the format allows for mixed dtypes)."""
    raw = chunk[offset : offset + (e.end - e.start)]
    if offset % e.dtype.itemsize:
        raw = raw.clone()
    return raw.view(e.dtype).view(e.shape)
