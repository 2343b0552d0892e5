"""Compiling Triton variants in other processes, started before the engine's own imports.

`precompile` (ember/kernels/precompile.py) compiles each variant its dry run meets in a thread
pool. Threads share one GIL with each other and with the dry run itself, and Triton's front end
(the kernel's Python AST to TTIR) and parts of its pass pipeline hold it: on an H200 the dry
run took 1.0 s alone and 3.5 s beside the compiles, and 26 variants took 40 s of summed compile
time started at once against 18 s spread out (docs/performance.md). Here the compiles run in
processes instead:

- `start_early()` runs first thing in the engine-core process (`engine_core_entry`, before it
  imports torch): it starts a server process (`python -m ember.kernels.compile_server`) that
  imports Triton and ember's kernel modules while the core imports its own, then forks its
  workers from that state (a fresh, single-threaded interpreter: safe to fork; each worker
  starts with everything imported).
- The core sends each variant the dry run meets (the kernel's module and name, Triton's
  serialized specialization, the GPU's target) as one JSON line; a worker compiles it into
  Triton's on-disk cache (the same `TRITON_CACHE_DIR`) and the server answers with a line.
- The core's own compile of the variant (`JITFunction.preload`, in precompile's thread pool)
  waits for that answer and then finds the variant in the cache: it only loads it.

A subprocess rather than `multiprocessing`: the engine core is itself a daemonic
multiprocessing child, which may not start multiprocessing children of its own. Anything that
fails here (the server cannot start, a worker raises, the server dies) leaves the variant to
the core's own compile, as without this module: it only saves time.

Nothing here imports torch at module level (`engine_core_entry` imports it before torch).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import IO, Any

log = logging.getLogger(__name__)


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


class CompileServer:
    """The core's side of one server process: `submit` a variant, get a Future of `Compiled`."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self._ids = itertools.count()
        self._pending: dict[int, Future[Compiled]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.started = time.time()
        self.ready_at: float | None = None
        """When the server had imported the kernels and forked its workers (its clock)."""
        assert proc.stdout is not None
        self._reader = threading.Thread(
            target=self._read, args=(proc.stdout,), name="triton-compile-server", daemon=True
        )
        self._reader.start()

    @classmethod
    def start(cls, workers: int, env: dict[str, str] | None = None) -> CompileServer:
        """Start the server with `workers` worker processes (its imports run from now on)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "ember.kernels.compile_server", str(workers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,  # a terminal's ^C is the core's to handle; killpg reaches all
        )
        return cls(proc)

    def submit(self, kernel: Any, data: str, target: Any) -> Future[Compiled] | None:
        """Compile one variant (Triton's specialization data for `kernel`) for `target` (a
        triton GPUTarget) in the server. None: the server cannot take it (a kernel another
        process cannot import by name, or the server is gone); compile it here."""
        address = kernel_address(kernel)
        if address is None or self._closed or self.proc.poll() is not None:
            return None
        job_id = next(self._ids)
        future: Future[Compiled] = Future()
        line = json.dumps(
            {
                "id": job_id,
                "module": address[0],
                "name": address[1],
                "data": data,
                "target": [target.backend, target.arch, target.warp_size],
            }
        )
        with self._lock:
            self._pending[job_id] = future
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(line + "\n")
                self.proc.stdin.flush()
            except (OSError, ValueError) as e:
                self._pending.pop(job_id, None)
                future.set_exception(e)
        return future

    @staticmethod
    def cached(kernel: Any, data: str, target: Any) -> bool:
        """Whether Triton's on-disk cache holds the variant already (then the core only loads
        it, without waiting for the server). Its first call in a process hashes Triton's own
        library (~0.5-1 s): call it on a compile thread, not on the dry run's."""
        try:
            src, options = variant_source(kernel, data, target)
            return in_cache(src, target, options)
        except Exception as e:
            log.debug("cache lookup of a variant failed: %s", e)
            return False

    def _fail(self, job_id: int, error: BaseException) -> None:
        with self._lock:
            future = self._pending.pop(job_id, None)
        if future is not None and not future.done():
            future.set_exception(error)

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            try:
                answer = json.loads(line)
                if "ready" in answer:
                    self.ready_at = float(answer["ready"])
                    continue
                job_id = int(answer["id"])
            except (ValueError, KeyError, TypeError):
                continue  # not an answer (a library printed to stdout): skip it
            with self._lock:
                future = self._pending.pop(job_id, None)
            if future is None:
                continue
            if answer.get("error"):
                future.set_exception(RuntimeError(answer["error"]))
            else:
                future.set_result(Compiled(float(answer["seconds"]), bool(answer["cache_hit"])))
        # The server is gone: whatever it still held compiles in the core.
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(RuntimeError("the compile server exited"))

    def readiness(self) -> str:
        """When it was ready, for the start-up log."""
        if self.ready_at is None:
            return f"not ready {time.time() - self.started:.1f} s after it started"
        return f"ready {self.ready_at - self.started:.1f} s after it started"

    def close(self, wait: bool = False) -> None:
        """Stop the server: it starts nothing more, and exits (its workers with it) once they
        finish what they run, ~1 s for its interpreter's exit. `wait`: until it has exited;
        else a thread reaps it (and kills it, and its workers, past 10 s)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # EOF: the server shuts its pool down and exits
        if wait:
            self._reap()
        else:
            threading.Thread(target=self._reap, name="triton-compile-reap", daemon=True).start()

    def _reap(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("Triton compile server did not exit in 10 s: killing it and its workers")
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the workers too
            self.proc.wait()
        self._reader.join(timeout=5)


_server: CompileServer | None = None


def start_early(workers: int | None = None) -> CompileServer | None:
    """Start the process's compile server (once); `precompile` uses it while it runs. Call it
    before anything sets Triton's cache elsewhere: the server compiles into the cache that the
    environment names now (ember's home unless TRITON_CACHE_DIR is set)."""
    global _server
    if _server is None:
        from ember.kernels.compile_log import use_ember_cache
        from ember.kernels.precompile import default_workers

        use_ember_cache()
        try:
            _server = CompileServer.start(workers or default_workers())
        except OSError as e:
            log.warning("Triton compile server not started (compiling in threads): %s", e)
    return _server


def running() -> CompileServer | None:
    """The compile server `start_early` started, if it is still up."""
    return _server


def stop() -> None:
    """Stop the process's compile server (start-up is over)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


# -- the server process ------------------------------------------------------------------------


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


def _noop() -> None:
    return None


def _kernel_modules() -> list[str]:
    """ember's kernel modules (each Triton kernel's home), imported before the workers fork."""
    import pkgutil

    import ember.kernels

    skip = {"compile_server", "precompile", "compile_log", "dispatch"}
    return [
        f"ember.kernels.{m.name}"
        for m in pkgutil.iter_modules(ember.kernels.__path__)
        if m.name not in skip
    ]


def serve(workers: int, stdin: IO[str], stdout: IO[str]) -> None:
    """Answer each job line of `stdin` with a line on `stdout` until EOF."""
    import importlib
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    for module in _kernel_modules():
        with contextlib.suppress(Exception):  # a module that cannot import: its jobs fail
            importlib.import_module(module)
    # Forked from this process, which holds no thread yet: each worker starts with Triton and
    # the kernels imported. (With fork, the pool starts all its workers at the first submit.)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    pool.submit(_noop)
    lock = threading.Lock()
    stdout.write(json.dumps({"ready": time.time()}) + "\n")
    stdout.flush()

    def answer(job_id: Any, future: Future[dict[str, Any]]) -> None:
        try:
            body: dict[str, Any] = future.result()
        except BaseException as e:  # noqa: BLE001 -- any failure is the job's answer
            body = {"error": f"{type(e).__name__}: {e}"[:2000]}
        with lock:
            stdout.write(json.dumps({"id": job_id, **body}) + "\n")
            stdout.flush()

    for line in stdin:
        try:
            job = json.loads(line)
            future = pool.submit(
                compile_variant, job["module"], job["name"], job["data"], job["target"]
            )
        except (ValueError, KeyError, TypeError) as e:
            with lock:
                stdout.write(json.dumps({"id": -1, "error": str(e)}) + "\n")
                stdout.flush()
            continue
        future.add_done_callback(lambda f, job_id=job["id"]: answer(job_id, f))
    pool.shutdown(wait=False, cancel_futures=True)


if __name__ == "__main__":
    # Its stdout is the answer channel: anything else printed goes to stderr.
    out = sys.stdout
    sys.stdout = sys.stderr
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else os.cpu_count() or 1, sys.stdin, out)
