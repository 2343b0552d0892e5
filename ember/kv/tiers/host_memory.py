"""The host tier's memory: one row of `row_bytes` per KV block, in chunks of (pinned) CPU memory.

Pinning tens of GiB at once stalls start-up (25 GiB took 17 s on an H100 machine), so on a GPU
the first chunk is pinned at once and a background thread pins the rest one chunk at a time: the
tier is usable at once and its capacity counts only the chunks already there. A slot (row id) is
`chunk * rows_per_chunk + row`; every chunk but the last holds `rows_per_chunk` rows. An engine
starts the memory when it starts (`ember/engine/kv_tiers.py`), so that it grows while the weights
load and the kernels compile, and is whole by the time the first request comes.

How a chunk is pinned: plain memory, kept out of forked children (MADV_DONTFORK: a fork copies
pinned pages at once, and the engine forks its Triton compile workers while the tier grows:
ember/host_pages.py), its pages touched first by the CPU (`memset` through ctypes, no driver
call, the GIL released), then cudaHostRegister through ctypes, one short driver call a chunk;
the chunks are unregistered at `close`. Measured on an H200 machine
(`benchmarks/probes/host_pinning.py`, 16 GiB in 64 MiB chunks in a thread while the main thread
ran tiny steps of a kernel, a 2 MiB copy and a sync; steps alone: p50 0.07 ms):

- `torch.empty(pin_memory=True)`: 0.43 s/GiB, and every step waited out a whole chunk (p50
  90 ms); torch also rounds each request up to a power of two.
- 4 KiB pages touched by one thread: 0.74 s/GiB (25 GiB: 18 s), steps p99 0.09 ms.
- transparent huge pages (`madvise`, 2 MiB pages: 512 times fewer faults), one thread: 0.21
  s/GiB, steps p99 0.11 ms; four threads: 0.12 s/GiB (25 GiB: 3 s), steps p99 2.0 ms, max 4 ms;
  eight threads and 1 GiB chunks: 0.10 s/GiB but a step waited 42 ms for one registration.

So the pages are huge where the kernel allows, touched by `FAULT_THREADS` threads while the
engine has no work and by one beside requests. `paused()` keeps the thread off the driver while
the engine captures CUDA graphs (another thread's driver calls would invalidate the capture).

Growing beside requests costs them: on an H200 the 8B shape's decode steps took 24% longer
(inter-token p50 20.3 against 16.4 ms) while the tier pinned 4 KiB pages, even resting twice each
chunk's time, and a fresh server's first mixed load ran 2-13% slower. So an engine sets the
growth's `pace` (ember/engine/core.py): "idle" while it has no work (no rests, several threads),
"busy" once its GPU cache evicts, when the tier starts to matter (rests, one thread), "hold"
otherwise: a tier that only duplicates what the GPU still holds waits for the next idle moment.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch

from ember.host_pages import advise_huge_pages, keep_from_forks

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20
FAULT_THREADS = 4
"""Threads that touch a chunk's pages at the "idle" pace (one at "busy")."""
GROWTH_IDLE_RATIO = 2.0
"""At the "busy" pace the growth rests this many times as long as each chunk took."""
Pace = Literal["hold", "idle", "busy"]
"""How the background growth goes on: not at all, without rests, or resting between chunks."""
Allocate = Callable[[int], torch.Tensor]
"""Allocates a flat uint8 CPU tensor of the given number of bytes (tests gate it)."""


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded, called through ctypes so the GIL is released during calls;
    None where it is not found (torch's own binding is used then)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _host_register(t: torch.Tensor) -> None:
    lib = _cudart()
    if lib is not None:
        rc = lib.cudaHostRegister(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.numel()), 0)
    else:
        rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of {t.numel()} bytes failed (CUDA error {rc})")


def _host_unregister(t: torch.Tensor) -> None:
    lib = _cudart()
    if lib is not None:
        lib.cudaHostUnregister(ctypes.c_void_p(t.data_ptr()))
    else:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


_unpin_pending: list[torch.Tensor] = []
_unpin_lock = threading.Lock()


def _release_chunks(chunks: list[torch.Tensor], registered: bool) -> None:
    """A memory's finalizer: its pinned chunks wait to be unpinned. No CUDA call here: a
    collection may run inside another engine's CUDA-graph capture, which a synchronize or an
    unregister would invalidate."""
    if registered:
        with _unpin_lock:
            _unpin_pending.extend(chunks)


def _unpin_released() -> None:
    """Unpin the chunks of memories dropped so far (before new memory is pinned, and at close:
    the places where no capture runs, see _Growth), then let them go."""
    with _unpin_lock:
        chunks = list(_unpin_pending)
        _unpin_pending.clear()
    if chunks:
        torch.cuda.synchronize()  # no copy may still be using them
        for chunk in chunks:
            _host_unregister(chunk)


def _touch(t: torch.Tensor, threads: int) -> None:
    """Fault `t`'s pages in on the CPU, outside the driver, on `threads` threads (ctypes releases
    the GIL; torch's fill_ would spread over every core of the intra-op pool, beside the
    engine's own host work)."""
    n = t.numel()
    step = -(-n // max(threads, 1))
    parts = [(t.data_ptr() + i, min(step, n - i)) for i in range(0, n, step)]
    if len(parts) == 1:
        ctypes.memset(parts[0][0], 0, parts[0][1])
        return
    workers = [threading.Thread(target=ctypes.memset, args=(p, 0, k)) for p, k in parts[1:]]
    for w in workers:
        w.start()
    ctypes.memset(parts[0][0], 0, parts[0][1])
    for w in workers:
        w.join()


def _pinned(nbytes: int, threads: int = 1) -> torch.Tensor:
    _unpin_released()  # a dropped memory's pages may come back from the allocator now
    t = torch.empty(nbytes, dtype=torch.uint8)
    advise_huge_pages(t)
    keep_from_forks(t)  # a forked compile worker would copy it (ember/host_pages.py)
    _touch(t, threads)
    _host_register(t)
    return t


def _plain(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


class _Growth:
    """Process-wide state of every host tier's growth. A cudaHostRegister from any thread while
    any engine of the process captures a CUDA graph invalidates the capture (CUDA error 900): with
    two engines in one process, the first one's tier was still pinning while the second captured
    its graphs. So a pause holds every tier's growth, and waits for any allocation under way."""

    cond = threading.Condition()
    paused = 0
    allocating = 0


class HostMemory:
    """Rows of `row_bytes` in chunks, grown up to `target_rows`; see the module's doc."""

    def __init__(
        self,
        row_bytes: int,
        target_rows: int,
        pin: bool,
        chunk_bytes: int = CHUNK_BYTES,
        background: bool | None = None,
        allocate: Allocate | None = None,
        on_grow: Callable[[int, int], None] | None = None,
        pace: Pace = "busy",
    ) -> None:
        """`pin`: page-locked memory (only when CUDA is available). `background`: grow in a
        thread after the first chunk (default: when pinned; plain memory is allocated lazily by
        the OS, at once). `on_grow(first_row, num_rows)` is called as each chunk arrives.
        `pace`: the background growth's, until set again (see `pace`)."""
        if row_bytes < 1 or target_rows < 1:
            raise ValueError(f"need rows of >= 1 byte and >= 1 row, got {row_bytes}, {target_rows}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.row_bytes = row_bytes
        self.target_rows = target_rows
        self.pinned = pin and torch.cuda.is_available()
        self.rows_per_chunk = max(1, chunk_bytes // row_bytes)
        self.chunks: list[torch.Tensor] = []
        """uint8 [rows, row_bytes] each: DMA targets of GPU copies, sources of lower tiers."""
        self._registered = allocate is None and self.pinned  # chunks to unregister at close
        self._allocate = allocate or (_pinned if self.pinned else _plain)
        self._on_grow = on_grow
        self._pace: Pace = pace
        self._num_rows = 0
        self._rows_lock = threading.Lock()  # a chunk's arrival against `attach`
        self._adding = threading.Lock()  # one chunk at a time: the growth thread or `grow_to`
        self._closed = False
        self._thread: threading.Thread | None = None
        # A memory dropped without close() (an engine never closed) must still be unpinned
        # before its pages go back to the allocator: the next pinning of the same addresses
        # failed with "already registered" (CUDA error 712) when a second engine started in the
        # process. The finalizer holds the chunk list, not self; the chunks live until unpinned.
        self._release = weakref.finalize(self, _release_chunks, self.chunks, self._registered)
        self._add_chunk()
        if background is None:
            background = self.pinned
        if not background:
            while self._num_rows < target_rows:
                self._add_chunk()
        elif self._num_rows < target_rows:
            self._thread = threading.Thread(target=self._grow, name="ember-kv-host", daemon=True)
            self._thread.start()

    @property
    def pace(self) -> Pace:
        return self._pace

    @pace.setter
    def pace(self, pace: Pace) -> None:
        """Hold the background growth, or let it go on without or with rests; a chunk under way
        is finished first."""
        if pace != self._pace:
            with _Growth.cond:
                self._pace = pace
                _Growth.cond.notify_all()

    def attach(self, on_grow: Callable[[int, int], None]) -> None:
        """Call `on_grow(first_row, num_rows)` for the rows allocated so far and for every chunk
        from now on (a memory started before its tier)."""
        with self._rows_lock:
            self._on_grow = on_grow
            if self._num_rows:
                on_grow(0, self._num_rows)

    @property
    def num_rows(self) -> int:
        """Rows allocated so far: the host tier's capacity now."""
        return self._num_rows

    @property
    def full(self) -> bool:
        return self._num_rows >= self.target_rows

    def locate(self, slot: int) -> tuple[torch.Tensor, int]:
        """The chunk holding `slot` and the slot's row in it."""
        if not 0 <= slot < self._num_rows:
            raise IndexError(f"slot {slot} outside the {self._num_rows} rows allocated")
        c, r = divmod(slot, self.rows_per_chunk)
        return self.chunks[c], r

    def row(self, slot: int) -> torch.Tensor:
        """Slot's row, a uint8 [row_bytes] view."""
        chunk, r = self.locate(slot)
        return chunk[r]

    def runs(
        self, slots: Sequence[int], others: Sequence[int]
    ) -> list[tuple[torch.Tensor, int, int, int]]:
        """(chunk, row, other, count): where slots and `others` (rows of another tensor) both
        advance by one within a chunk, so that each run is one copy."""
        out: list[tuple[torch.Tensor, int, int, int]] = []
        last_c = -1
        for slot, other in zip(slots, others, strict=True):
            self.locate(slot)
            c, r = divmod(slot, self.rows_per_chunk)
            if out and c == last_c:
                chunk, r0, o0, n = out[-1]
                if r == r0 + n and other == o0 + n:
                    out[-1] = (chunk, r0, o0, n + 1)
                    continue
            out.append((self.chunks[c], r, other, 1))
            last_c = c
        return out

    def copy_in(
        self, slots: Sequence[int], src: torch.Tensor, ids: Sequence[int], non_blocking: bool
    ) -> None:
        """Rows `ids` of `src` (a KV cache as uint8 [blocks, row_bytes]) into `slots`: one copy
        per run of rows both sides have in a row (within a chunk)."""
        for chunk, r, g, n in self.runs(slots, ids):
            chunk[r : r + n].copy_(src[g : g + n], non_blocking=non_blocking)

    def copy_out(
        self, slots: Sequence[int], dst: torch.Tensor, ids: Sequence[int], non_blocking: bool
    ) -> None:
        """`slots` into rows `ids` of `dst`, one copy per run (see `copy_in`)."""
        for chunk, r, g, n in self.runs(slots, ids):
            dst[g : g + n].copy_(chunk[r : r + n], non_blocking=non_blocking)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No allocation runs inside this block, in any host tier of the process (one under way
        is waited for first)."""
        with _Growth.cond:
            _Growth.paused += 1
            while _Growth.allocating:
                _Growth.cond.wait()
        try:
            yield
        finally:
            with _Growth.cond:
                _Growth.paused -= 1
                _Growth.cond.notify_all()

    def grow_to(self, rows: int) -> None:
        """Allocate chunks now, on this thread, until `rows` rows (at most `target_rows`) are
        there: a tensor-parallel worker's copy of rank 0's tier, asked for a slot that its own
        growth has not reached yet (ember/kv/tiers/replica.py)."""
        while self._num_rows < min(rows, self.target_rows) and not self._closed:
            self._add_chunk()

    def wait_full(self, timeout_s: float | None = None) -> bool:
        """Whether every row is allocated (waiting up to `timeout_s`); False if growth stopped.
        A memory held (`pace` "hold") does not grow while it waits."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return self.full

    def close(self) -> None:
        """Stop growing (a chunk under way is finished first) and unpin the chunks; the memory
        must no longer be read or written."""
        with _Growth.cond:
            if self._closed:
                return
            self._closed = True
            _Growth.cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._release()
        _unpin_released()

    def _add_chunk(self) -> None:
        with self._adding:
            if self._num_rows < self.target_rows:
                self._add_chunk_now()

    def _add_chunk_now(self) -> None:
        rows = min(self.rows_per_chunk, self.target_rows - self._num_rows)
        if self._allocate is _pinned:
            threads = FAULT_THREADS if self._pace == "idle" else 1
            flat = _pinned(rows * self.row_bytes, threads)
        else:
            flat = self._allocate(rows * self.row_bytes)
        chunk = flat.view(rows, self.row_bytes)
        with self._rows_lock:
            first = self._num_rows
            self.chunks.append(chunk)  # before the rows count, so they are there once handed out
            self._num_rows += rows
            if self._on_grow is not None:
                self._on_grow(first, rows)

    def _grow(self) -> None:
        t0 = time.perf_counter()
        while True:
            with _Growth.cond:
                while (_Growth.paused or self._pace == "hold") and not self._closed:
                    _Growth.cond.wait()
                if self._closed or self.full:
                    break
                _Growth.allocating += 1
            started = time.perf_counter()
            try:
                self._add_chunk()
            except (RuntimeError, MemoryError) as e:  # out of pinnable memory: keep what we have
                log.warning(
                    "KV host tier: stopped growing at %.2f GiB: %s", self._gib(self._num_rows), e
                )
                return
            finally:
                with _Growth.cond:
                    _Growth.allocating -= 1
                    _Growth.cond.notify_all()
            # A duty cycle beside requests, whose steps share the host's memory bandwidth and
            # the driver with the growth.
            if self._pace == "busy":
                time.sleep((time.perf_counter() - started) * GROWTH_IDLE_RATIO)
        if self.full:
            log.info(
                "KV host tier: %.2f GiB %s in %.1f s",
                self._gib(self._num_rows),
                "pinned" if self.pinned else "allocated",
                time.perf_counter() - t0,
            )

    def _gib(self, rows: int) -> float:
        return rows * self.row_bytes / (1 << 30)
