"""Compiling Triton variants in worker processes forked from the engine core.

`precompile` (ember/kernels/precompile.py) compiles each variant its dry run meets in a thread
pool. Threads share one GIL with each other and with the dry run itself, and Triton's front end
(the kernel's Python AST to TTIR) and parts of its pass pipeline hold it: on an H200 the dry
run took 1.0 s alone and 3.5 s beside the compiles (docs/performance.md). Here each variant
compiles in a worker process instead, and the core's own compile of it (`JITFunction.preload`,
on a pool thread) waits for the worker and then finds the variant in Triton's on-disk cache:
it only loads it.

The workers are forked from the core as the dry run needs them (a few ms each), so they start
with Triton and the kernels imported and cost no import of their own. A first design started
a server process with its own imports beside the core's: the two imports slowed each other by
~0.7 s on the device machines, and the server's exit slowed the graph capture after it, which
ate its gain. A forked worker touches no CUDA (it compiles for the target the core names, and
builds the variant's launcher, a C file, with the system's compiler), resets the core's signal
handling, dies with the core (PR_SET_PDEATHSIG), and leaves by `os._exit` (no atexit or
finalizer of the core's runs in it). Not `multiprocessing`: the engine core is a daemonic
multiprocessing child, which may not start multiprocessing children of its own.

Anything that fails here (a fork, a worker's compile, a worker that dies) leaves the variant to
the core's own compile, as without this module: it only saves time.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import logging
import os
import signal
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Compiled:
    """A worker's answer for one variant."""

    seconds: float
    """Seconds the worker's compile took (0 for a cache hit)."""
    cache_hit: bool
    """The variant was in the on-disk cache already: nothing was compiled."""


def kernel_address(kernel: Any) -> tuple[str, str] | None:
    """(module, name) under which another process imports the same JITFunction, or None where
    that would not give this one (a kernel made inside a function, or rebound)."""
    import importlib

    module = getattr(kernel, "__module__", None)
    name = getattr(getattr(kernel, "fn", None), "__name__", None)
    if not module or not name:
        return None
    try:
        if getattr(importlib.import_module(module), name, None) is kernel:
            return module, name
    except Exception:
        return None
    return None


class CompileWorkers:
    """Worker processes forked from this one, up to `limit`, each compiling one variant at a
    time: `submit` a variant, get a Future of `Compiled`. Call `close()` when done."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: dict[int, Future[Compiled]] = {}
        self._queue: deque[tuple[int, bytes]] = deque()  # jobs no worker was free for
        self._job_of: dict[Future[Compiled], int] = {}  # each submitted future's job id
        self._workers: dict[int, int] = {}  # a live worker's job pipe (write end) -> its pid
        self._idle: list[int] = []  # job pipes of the workers that wait for a job
        self._running: dict[int, int] = {}  # job pipe -> the job its worker runs
        self._closed = False
        self._futures: dict[tuple[str, str, str, str], Future[Compiled]] = {}
        """Each variant's future, by its kernel's address and specialization: a variant
        submitted again (met before the model loaded, then by the start-up's dry run) is the
        same job."""
        self.forked = 0
        """Workers forked so far."""
        self.reused = 0
        """Submissions answered with an earlier submission's future."""
        self.fork_s = 0.0
        """Seconds this process spent in fork() (on the thread that submitted the job)."""
        self._results_r, self._results_w = os.pipe()
        self._reader = threading.Thread(
            target=self._read, name="triton-compile-results", daemon=True
        )
        self._reader.start()

    def submit(self, kernel: Any, data: str, target: Any) -> Future[Compiled] | None:
        """Compile one variant (Triton's specialization data for `kernel`) for `target` (a
        triton GPUTarget) in a worker. None: it cannot (a kernel another process cannot
        import by name, or closed); compile it here. A variant submitted before gets the
        future of its first submission."""
        address = kernel_address(kernel)
        if address is None or self._closed:
            return None
        key = (*address, data, repr(target))
        with self._lock:
            known = self._futures.get(key)
            if known is not None:
                self.reused += 1
                return known
        job_id = next(self._ids)
        line = json.dumps(
            {
                "id": job_id,
                "module": address[0],
                "name": address[1],
                "data": data,
                "target": [target.backend, target.arch, target.warp_size],
            }
        )
        future: Future[Compiled] = Future()
        with self._lock:
            self._futures[key] = future
            self._job_of[future] = job_id
            self._pending[job_id] = future
            self._queue.append((job_id, (line + "\n").encode()))
            self._dispatch()
        return future

    def queued(self, future: Future[Compiled]) -> bool:
        """Whether `future`'s job still waits for a worker (none has begun it): a variant in
        the on-disk cache then was not put there by this start's worker."""
        with self._lock:
            job_id = self._job_of.get(future)
            return job_id is not None and any(j == job_id for j, _ in self._queue)

    @property
    def submitted(self) -> int:
        """Variants submitted so far (each once)."""
        return len(self._futures)

    def _dispatch(self) -> None:
        """Hand queued jobs to free workers, forking one while under the limit (lock held)."""
        while self._queue and not self._closed:
            if not self._idle and len(self._workers) < self.limit:
                self._fork()
            if not self._idle:
                return
            job_id, payload = self._queue.popleft()
            pipe = self._idle.pop()
            try:
                os.write(pipe, payload)
            except OSError as e:  # the worker is gone (its waiter removes it)
                self._settle(job_id, error=e)
                continue
            self._running[pipe] = job_id

    def _fork(self) -> None:
        job_r, job_w = os.pipe()
        try:
            with warnings.catch_warnings():
                # Python 3.12 warns of any fork of a threaded process: a lock another thread
                # holds stays held in the child. The worker takes none of the core's locks that
                # way (no CUDA, no logging, no torch; Python resets its own at fork).
                warnings.filterwarnings("ignore", ".*multi-threaded.*", DeprecationWarning)
                t = time.perf_counter()
                pid = os.fork()
                if pid:
                    self.fork_s += time.perf_counter() - t
        except OSError as e:
            os.close(job_r)
            os.close(job_w)
            self.limit = len(self._workers)  # no more forks
            log.warning("forking a Triton compile worker failed (compiling in threads): %s", e)
            return
        if pid == 0:  # the worker: it keeps only its job pipe's read end and the results pipe
            code = 1
            try:
                for fd in (job_w, self._results_r, *self._workers):
                    os.close(fd)
                code = _work(job_r, self._results_w)
            finally:
                os._exit(code)
        os.close(job_r)
        self._workers[job_w] = pid
        self._idle.append(job_w)
        self.forked += 1
        threading.Thread(
            target=self._wait, args=(pid, job_w), name="triton-compile-wait", daemon=True
        ).start()

    def _wait(self, pid: int, pipe: int) -> None:
        """Reap a worker when it exits (at close, or killed): a job it was running fails (the
        core compiles it itself), and another worker may be forked for the queue."""
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
        with self._lock:
            self._workers.pop(pipe, None)
            if pipe in self._idle:
                self._idle.remove(pipe)
            job_id = self._running.pop(pipe, None)
            if job_id is not None:
                self._settle(job_id, error=RuntimeError("the compile worker exited"))
            if not self._closed:  # (close() has closed every pipe: its number may be reused)
                with contextlib.suppress(OSError):
                    os.close(pipe)
                self._dispatch()

    def _settle(
        self, job_id: int, done: Compiled | None = None, error: BaseException | None = None
    ) -> None:
        future = self._pending.pop(job_id, None)
        if future is not None and not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(done)

    def _read(self) -> None:
        with os.fdopen(self._results_r, "r", encoding="utf-8") as results:
            for line in results:
                try:
                    answer = json.loads(line)
                    job_id = int(answer["id"])
                except (ValueError, KeyError, TypeError):
                    continue
                with self._lock:
                    pipe = next((p for p, j in self._running.items() if j == job_id), None)
                    if pipe is not None:
                        del self._running[pipe]
                        self._idle.append(pipe)  # its worker waits for the next job
                    if answer.get("error"):
                        self._settle(job_id, error=RuntimeError(answer["error"]))
                    else:
                        done = Compiled(float(answer["seconds"]), bool(answer["cache_hit"]))
                        self._settle(job_id, done)
                    self._dispatch()

    def close(self) -> None:
        """Stop the workers: an idle one exits at once (no finalizers), a busy one after its
        job. Jobs not yet answered fail (the core compiles them itself)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for pipe in self._workers:
                with contextlib.suppress(OSError):
                    os.close(pipe)  # EOF: the worker exits (its waiter finds the fd closed)
            pending, self._pending, self._queue = self._pending, {}, deque()
            with contextlib.suppress(OSError):
                os.close(self._results_w)  # the reader ends once the workers have exited
        for future in pending.values():
            if not future.done():
                future.set_exception(RuntimeError("the compile workers were stopped"))


def _work(job_r: int, results_w: int) -> int:
    """A worker's life: compile each job line of `job_r`, answer on `results_w` (one line,
    written at once: under the pipe's atomic size), until EOF."""
    # The core's signal handling is not the worker's: a ^C or SIGTERM just ends it.
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):
            signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(Exception):  # Linux: die with the core, whatever kills it
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    with os.fdopen(job_r, "r", encoding="utf-8") as jobs:
        for line in jobs:
            job_id: Any = -1
            try:
                job = json.loads(line)
                job_id = job["id"]
                body = compile_variant(job["module"], job["name"], job["data"], job["target"])
            except BaseException as e:  # noqa: BLE001 -- any failure is the job's answer
                body = {"error": f"{type(e).__name__}: {e}"[:1000]}
            os.write(results_w, (json.dumps({"id": job_id, **body}) + "\n").encode())
    return 0


def cached(kernel: Any, data: str, target: Any) -> bool:
    """Whether Triton's on-disk cache holds the variant already (then the core only loads it,
    without waiting for a worker). Its first call in a process hashes Triton's own library
    (~0.5-1 s): call it on a compile thread, not on the dry run's."""
    try:
        src, options = variant_source(kernel, data, target)
        return in_cache(src, target, options)
    except Exception as e:
        log.debug("cache lookup of a variant failed: %s", e)
        return False


def variant_source(fn: Any, data: str, target: Any) -> tuple[Any, dict[str, Any]]:
    """(Triton's ASTSource, options) of the variant `data` (Triton's serialized specialization)
    of kernel `fn` for `target` (a GPUTarget), as Triton 3.6's `JITFunction.preload` builds them;
    preload itself needs the GPU's driver for its device and target, which a worker has not."""
    import triton.language as tl
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.jit import convert_to_tuple_if_list

    obj = json.loads(data)
    constexprs = {
        tuple(key): tl.dtype(value)
        if tl.dtype.is_dtype(value)
        else tl.constexpr(value["constexpr"])
        if isinstance(value, dict) and "constexpr" in value
        else value
        for key, value in zip(obj["constant_keys"], obj["constant_vals"], strict=True)
    }
    attrs = {tuple(k): v for k, v in zip(obj["attrs_keys"], obj["attrs_vals"], strict=True)}
    signature = {k: convert_to_tuple_if_list(v) for k, v in obj["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()}
    options = make_backend(target).parse_options(options)
    return ASTSource(fn, signature, constexprs, attrs), options.__dict__


def in_cache(src: Any, target: Any, options: dict[str, Any]) -> bool:
    """Whether Triton's on-disk cache holds the variant: the key and lookup of Triton 3.6's
    `compile` (which would load it from there)."""
    import hashlib

    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager
    from triton.runtime.jit import get_cache_invalidating_env_vars

    backend = make_backend(target)
    opts = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, opts, get_cache_invalidating_env_vars())
    name = f"{src.name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name)
    return bool(group) and name in group


def compile_variant(module: str, name: str, data: str, target: list[Any]) -> dict[str, Any]:
    """Compile one variant into Triton's on-disk cache, as `JITFunction.preload(data)` would on
    a GPU of `target`: the same source and options, so the cache key is the one the core's own
    preload computes (a test checks that it then hits)."""
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    fn = getattr(importlib.import_module(module), name)
    gpu = GPUTarget(*target)
    src, options = variant_source(fn, data, gpu)
    hits: list[bool] = []
    knobs.compilation.listener = lambda *, cache_hit, **_: hits.append(cache_hit)
    t0 = time.perf_counter()
    compiled = triton.compile(src, target=gpu, options=options)
    hit = bool(hits and hits[-1])
    seconds = 0.0 if hit else time.perf_counter() - t0
    if gpu.backend == "cuda":
        # Its launcher too (a C file per argument signature, built with the system's compiler
        # into the same cache), which the core's first load would otherwise build. Where that
        # fails (no libcuda here), the core builds it, as without this.
        with contextlib.suppress(Exception):
            from triton.backends.nvidia.driver import CudaLauncher

            CudaLauncher(src, compiled.metadata)
    return {"seconds": seconds, "cache_hit": hit}
