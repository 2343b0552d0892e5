"""One Mooncake Store client, kept connected to its `mooncake_master` for the store tier.

The tier reports each failure (`fail`); from then on `client` is None (every call a miss) while a
thread probes the master with back-off (0.5 s doubling to 30 s) until it answers, and one warning
is logged per outage. A client re-mounts itself on a master restarted on the same port (whose
index starts empty); a master never reached is retried with a fresh client.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from ember.kv.tiers.store_master import accepts, split_address
from ember.kv.transport.listen_host import PinError, loaded_libraries, pinned_bind
from ember.kv.transport.mooncake import _start_log_filtered

log = logging.getLogger(__name__)

BACKOFF_S = (0.5, 30.0)
"""Probe after 0.5 s, then 1, 2 ... up to 30 s while the store keeps failing."""


class StoreError(RuntimeError):
    """The store tier cannot be built at all (Mooncake is not installed, a bad argument)."""


class StoreConnection:
    def __init__(
        self,
        master: str,
        host: str,
        segment_bytes: int,
        probe_key: str,
        protocol: str = "tcp",
        device: str = "",
        connect_timeout_s: float = 2.0,
    ) -> None:
        """`master`: HOST:PORT; `host`: the only address the client listens on; `segment_bytes`:
        the memory it lends the store; `probe_key`: a key whose lookup tells the master answers;
        `connect_timeout_s`: how long start-up waits for the first connection."""
        try:
            self._master_host, self._master_port = split_address(master)
        except ValueError as e:
            raise StoreError(f"--kv-store: {e}") from None
        # Mooncake's glog writes INFO lines (ports, topology) at every start; keep its warnings.
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        # The default TCP slice (64 KiB) makes loopback transfers many times slower.
        os.environ.setdefault("MC_TCP_SLICE_SIZE", "4194304")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StoreError(
                "the Mooncake store is not installed: pip install 'ember[pd-cpu]' (and Debian's "
                "libibverbs1, libnuma1, libcurl4) on CPU machines, mooncake-transfer-engine on GPUs"
            ) from e
        self._new_client: Callable[[], Any] = MooncakeDistributedStore
        self.master = master
        self.host = host
        self.segment_bytes = segment_bytes
        self._probe_key = probe_key
        self._protocol, self._device = protocol, device
        self._client: Any = None
        self._lock = threading.Lock()
        self._outage: str | None = None
        self._failures = 0
        self._up = threading.Event()
        self._wake = threading.Event()
        self._closed = threading.Event()
        # The first connection is made here, with Mooncake's start-up chatter filtered (that holds
        # the process's stderr for a moment, which only start-up may do); the rest in a thread.
        if accepts(self._master_host, self._master_port):
            self._client = self._setup(quiet=True)
            if self._client is not None:
                self._up.set()
        self._connector = threading.Thread(target=self._reconnect, name="kv-store", daemon=True)
        self._connector.start()
        if not self._up.wait(connect_timeout_s):
            self.fail(f"no answer from the master in {connect_timeout_s:.1f} s")

    @property
    def client(self) -> Any:
        """The Mooncake client while the store answers; None during an outage or once closed."""
        return self._client if self._up.is_set() else None

    @property
    def connected(self) -> bool:
        return self._up.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        """Whether it is (or becomes, within `timeout_s`) connected."""
        return self._up.wait(timeout_s)

    def fail(self, reason: str) -> None:
        """Go down (no client) and let the connector probe the master again."""
        with self._lock:
            self._failures += 1
            first = self._outage is None
            if first:
                self._outage = reason
            self._up.clear()
        self._wake.set()
        if first and not self._closed.is_set():
            log.warning(
                "KV store at %s: %s; its blocks are recomputed until it answers again",
                self.master,
                reason,
            )

    def succeeded(self) -> None:
        """Blocks moved: the outage, if any, is over (and the back-off starts again at 0.5 s)."""
        with self._lock:
            over, self._outage = self._outage, None
            self._failures = 0
        if over is not None:
            log.warning("KV store at %s answers again (after: %s)", self.master, over)

    def close(self) -> None:
        """Leave the store: this client's segment (and the blocks in it) goes with it."""
        self._closed.set()
        self._wake.set()
        with self._lock:
            self._up.clear()
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as e:  # closing is best effort: the process may be going anyway
                log.debug("KV store client close: %s", e)

    def _reconnect(self) -> None:
        """The connector thread: while down, probe the master with back-off."""
        lo, hi = BACKOFF_S
        attempt = 0
        while not self._closed.is_set():
            if self._up.is_set():
                self._wake.wait()
                self._wake.clear()
                continue
            if attempt:
                with self._lock:
                    failures = self._failures
                if self._closed.wait(min(hi, lo * 2 ** max(0, failures - 1))):
                    return
            attempt += 1
            if self._connect_once():
                self._up.set()
            else:
                with self._lock:
                    self._failures += 1

    def _connect_once(self) -> bool:
        # A refused port fails here at once; the library would retry a dead master for 90 s.
        if not accepts(self._master_host, self._master_port):
            return False
        if self._client is None:
            client = self._setup()
            with self._lock:
                if client is None or self._closed.is_set():
                    return False
                self._client = client
            return True
        try:
            codes = self._client.batch_is_exist([self._probe_key])
        except Exception:  # closed meanwhile, or the binding raised: still down
            return False
        return len(codes) == 1 and codes[0] in (0, 1)

    def _setup(self, quiet: bool = False) -> Any:
        """A client connected to the master, listening on `host` only; None if it failed.
        `quiet`: hold back the lines Mooncake prints at every start that say nothing is wrong."""
        client = self._new_client()
        folder = os.path.dirname(os.path.dirname(sys.modules[type(client).__module__].__file__))
        libraries = [p for p in loaded_libraries(folder) if "/mooncake" in p]

        def setup() -> int:
            return client.setup(
                self.host,
                "P2PHANDSHAKE",  # peers find each other without a metadata server
                self.segment_bytes,
                0,  # no local buffer: every read and write goes through registered memory
                self._protocol,
                self._device,
                self.master,
            )

        try:
            with _start_log_filtered(self._protocol) if quiet else nullcontext():
                try:
                    with pinned_bind(libraries, self.host):
                        rc = setup()
                except PinError as e:
                    log.warning(
                        "KV store client listens on every interface, not only %s: %s", self.host, e
                    )
                    rc = setup()
        except Exception as e:  # the binding raised: no client this time
            log.debug("KV store setup failed: %s", e)
            return None
        if rc != 0:
            log.debug("KV store setup returned %s", rc)
            return None
        return client
