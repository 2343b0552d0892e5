"""KVTransport over Mooncake Transfer Engine: TCP here and in CI, RDMA or NVLink on GPU clusters.

Peers find each other with no metadata server (P2PHANDSHAKE): a peer's address is the
"host:rpc_port" its engine listens on, and the first transfer to it does the handshake.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from ipaddress import ip_address
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any, TypeVar

from ember.kv.transport.base import KVTransport, TransferError, check_batch, check_registrable
from ember.kv.transport.listen_host import (
    PinError,
    listening_sockets,
    loaded_libraries,
    pinned_bind,
    resolve_ip,
)

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
log = logging.getLogger(__name__)

# The library's own allowance for moving bytes, on top of its fixed timeout (1 GiB per second).
_BYTES_PER_S = 1 << 30


class MooncakeTransport(KVTransport):
    name = "mooncake"
    exposed = True  # any process that reaches the port may read and write registered memory

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", timeout_s: float = 30.0):
        # The default TCP slice (64 KiB) makes loopback transfers many times slower.
        os.environ.setdefault("MC_TCP_SLICE_SIZE", "4194304")
        # Mooncake's glog writes INFO lines to stderr at every start (topology, ports); its own
        # MC_LOG_LEVEL (not glog's GLOG_minloglevel, which it ignores) keeps warnings and errors.
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        try:
            import mooncake.engine as native  # lazy: the wheel is an optional extra
        except ImportError as e:
            raise TransferError(
                "the Mooncake transfer engine is not installed: pip install 'ember[pd-cpu]' "
                "(and Debian's libibverbs1) on CPU machines, mooncake-transfer-engine on GPUs"
            ) from e

        engine = native.TransferEngine()
        # The wheel's own libraries (engine.so, libasio.so, ...) sit in and beside its package.
        libraries = loaded_libraries(os.path.dirname(os.path.dirname(native.__file__)))
        libraries = [p for p in libraries if "/mooncake" in p]
        if _initialize(engine, libraries, host, protocol) != 0:
            raise TransferError(f"Mooncake failed to initialize on {host} over {protocol}")
        self._engine: Any = engine
        self._address = f"{host}:{engine.get_rpc_port()}"
        self._timeout_s = timeout_s
        self._workers = _Workers()

    def register(self, tensor: torch.Tensor) -> int:
        nbytes = check_registrable(tensor)
        ptr = tensor.data_ptr()
        if self._live().register_memory(ptr, nbytes) != 0:
            raise TransferError(f"Mooncake could not register {nbytes} bytes at {ptr:#x}")
        return ptr

    @property
    def address(self) -> str:
        return self._address

    def read(
        self,
        peer: str,
        remote_addrs: Sequence[int],
        local_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        nbytes = check_batch(remote_addrs, local_addrs, lengths)
        # Mooncake's order is (peer, local buffers, peer buffers, lengths) for reads and writes.
        self._run("read", peer, local_addrs, remote_addrs, lengths, nbytes)

    def write(
        self,
        peer: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        nbytes = check_batch(local_addrs, remote_addrs, lengths)
        self._run("write", peer, local_addrs, remote_addrs, lengths, nbytes)

    def _run(
        self,
        what: str,
        peer: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
        nbytes: int,
    ) -> None:
        call: Callable[..., int] = getattr(self._live(), f"batch_transfer_sync_{what}")
        if not lengths:
            return
        args = (peer, list(local_addrs), list(remote_addrs), list(lengths))
        # The library bounds a stalled transfer itself (MC_TRANSFER_TIMEOUT, 30 s, plus 1 s a GB)
        # but not tightly the handshake with a new peer: one that accepts the connection and never
        # answers holds the call, and the engine's lock with it (every other transfer waits), for
        # about 60 s. So the call runs on a worker thread and we stop waiting at our own deadline.
        deadline = self._timeout_s + nbytes / _BYTES_PER_S
        try:
            rc = self._workers.submit(lambda: call(*args)).result(timeout=deadline)
        except FutureTimeout:
            raise TransferError(
                f"Mooncake {what} of {nbytes} bytes with {peer} did not finish in {deadline:.1f} s"
            ) from None
        except Exception as exc:
            raise TransferError(f"Mooncake {what} with {peer} failed: {exc}") from exc
        if rc < 0:
            # The library says only -1; its log (stderr) says why: a refused or dead peer, an
            # address outside the peer's registered memory, or a timeout.
            raise TransferError(
                f"Mooncake {what} of {nbytes} bytes in {len(lengths)} regions with {peer} failed"
                f" (rc={rc})"
            )

    def _live(self) -> Any:
        if self._engine is None:
            raise TransferError("the Mooncake transport is closed")
        return self._engine

    def close(self) -> None:
        # Dropping the engine frees its registrations and connections (its destructor takes ~1 s);
        # a call that timed out still holds the engine until the library lets that call go.
        self._workers.close()
        self._engine = None


BENIGN_START_LINES = (
    "Local segment descriptor not found",  # E-level, at every P2P start: no segment registered yet
    "Logging before InitGoogleLogging",
    "Using default malloc/free for protocol: tcp",
)
BENIGN_TCP_START_LINES = ("No RDMA devices found",)
"""What Mooncake prints at every start that says nothing is wrong (no RDMA is news only to an
RDMA set-up). Every other line it prints while starting is passed on."""


@contextmanager
def _start_log_filtered(protocol: str) -> Iterator[None]:
    """Hold the native library's stderr (fd 2) while it starts, then pass on all but the lines
    above: `ember serve` should not greet its user with an E-level line that means nothing."""
    benign = BENIGN_START_LINES + (BENIGN_TCP_START_LINES if protocol == "tcp" else ())
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            kept = [line for line in lines if not any(b in line for b in benign)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _initialize(engine: Any, libraries: list[str], host: str, protocol: str) -> int:
    """Start the engine with its two listeners (handshake, TCP data) bound to `host` only."""
    with _start_log_filtered(protocol):
        return _initialize_bound(engine, libraries, host, protocol)


def _initialize_bound(engine: Any, libraries: list[str], host: str, protocol: str) -> int:
    before = listening_sockets()
    try:
        with pinned_bind(libraries, host):
            rc = engine.initialize(host, "P2PHANDSHAKE", protocol, "")
    except PinError as e:
        log.warning("Mooncake listens on every interface, not only %s: %s", host, e)
        return engine.initialize(host, "P2PHANDSHAKE", protocol, "")
    wide = {a for a in listening_sockets() - before if ip_address(a[0]).is_unspecified}
    if wide and not resolve_ip(host).is_unspecified:
        log.warning("Mooncake listens on every interface, not only %s: %s", host, sorted(wide))
    return rc


class _Workers:
    """Daemon threads that run blocking calls; one that hangs is left behind, never waited on.

    An idle thread is reused (a queue hand-off costs ~20 us; starting a thread, ~175 us here), and
    a call that finds none idle starts another, so no call queues behind a stuck one.
    """

    def __init__(self) -> None:
        self._idle: list[SimpleQueue[Any]] = []
        self._busy = 0
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
            self._busy += 1
        if jobs is None:
            jobs = SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), name="mooncake", daemon=True).start()
        jobs.put((fn, fut))
        return fut

    def _serve(self, jobs: SimpleQueue[Any]) -> None:
        while (job := jobs.get()) is not None:
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the waiting caller
                fut.set_exception(exc)
            del job, fn, fut  # drop the call's references (the engine) before idling
            with self._lock:
                self._busy -= 1
                if self._closed:
                    return
                self._idle.append(jobs)

    def close(self) -> int:
        """Stop the idle threads; return how many calls are still running."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = self._busy
        for jobs in idle:
            jobs.put(None)
        return busy
