"""Pick a KV transport backend by name (kept apart from the interface: the backends import it)."""

from __future__ import annotations

from ember.kv.transport.base import KVTransport


def make_transport(kind: str, host: str = "127.0.0.1", timeout_s: float = 30.0) -> KVTransport:
    """A transport of `kind` ("mooncake" | "cuda_ipc"); `host` is where Mooncake listens, and
    `timeout_s` bounds one of its transfers (plus 1 s a GiB)."""
    # Imported here so that naming one backend never loads the other's library.
    if kind == "mooncake":
        from ember.kv.transport.mooncake import MooncakeTransport

        return MooncakeTransport(host, timeout_s=timeout_s)
    if kind == "cuda_ipc":
        from ember.kv.transport.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport()
    raise ValueError(f"unknown KV transport {kind!r} (expected 'mooncake' or 'cuda_ipc')")
