"""Starts and stops a `mooncake_master`: the metadata service of the Mooncake Store tier.

The master holds only metadata (which block lies in which client's memory); the bytes live in the
segments the engines' store clients mount. Clients find each other without a metadata server
(P2PHANDSHAKE), so the master's HTTP metadata server stays off. Used by `ember up --store` and by
the tests.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ember.parent_death import child_dies_with_us

MASTER_BINARY = "mooncake_master"


class MasterError(RuntimeError):
    """The master could not be found or did not start."""


def master_binary() -> str | None:
    """The `mooncake_master` of the installed Mooncake wheel (else one on PATH); None if none."""
    spec = importlib.util.find_spec("mooncake")  # finds the package without loading its libraries
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / MASTER_BINARY
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which(MASTER_BINARY)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "HOST:PORT" or "[V6HOST]:PORT"; ValueError if it is neither."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


def accepts(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@dataclass(slots=True)
class StoreMaster:
    """One running `mooncake_master`, listening on `host` only (its RPC and its metrics ports)."""

    host: str
    port: int
    metrics_port: int
    log_path: str | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        """HOST:PORT, what engines take as `--kv-store`."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self, timeout_s: float = 10.0) -> StoreMaster:
        """Start it (again, on the same ports) and wait until it accepts connections."""
        binary = master_binary()
        if binary is None:
            raise MasterError(
                "mooncake_master is not installed: pip install 'ember[pd-cpu]' (CPU machines) "
                "or mooncake-transfer-engine (GPUs)"
            )
        cmd = [
            binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=false",
            "--enable_metric_reporting=false",  # else a long summary line every few seconds
            "--logtostderr",  # glog would otherwise write files under /tmp
        ]
        log: IO[bytes] | int = subprocess.DEVNULL  # no log file: its log goes nowhere
        if self.log_path:
            log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it; closed below
        try:
            self.popen = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # Ctrl-C goes to `ember up`, which stops it after the engines
                preexec_fn=child_dies_with_us(),  # noqa: PLW1509 - and a killed `ember up` stops it
            )
        finally:
            if not isinstance(log, int):
                log.close()
        deadline = time.monotonic() + timeout_s
        while not accepts(self.host, self.port, timeout_s=0.5):
            if self.popen.poll() is not None:
                raise MasterError(
                    f"mooncake_master exited with {self.popen.returncode} while starting on "
                    f"{self.address}" + (f" (log: {self.log_path})" if self.log_path else "")
                )
            if time.monotonic() > deadline:
                self.stop()
                raise MasterError(f"mooncake_master did not listen on {self.address} in time")
            time.sleep(0.05)
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; a stopped master is left as it is."""
        p = self.popen
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def kill(self) -> None:
        """SIGKILL: a crash, for fault tests."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def start_master(
    host: str = "127.0.0.1",
    port: int | None = None,
    log_path: str | None = None,
    timeout_s: float = 10.0,
) -> StoreMaster:
    """A `mooncake_master` on `host` (on free ports unless `port` is given), accepting clients."""
    rpc_port = port or free_port(host)
    metrics_port = free_port(host)
    while metrics_port == rpc_port:
        metrics_port = free_port(host)
    return StoreMaster(host, rpc_port, metrics_port, log_path).start(timeout_s)
