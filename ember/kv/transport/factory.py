"""Pick a KV transport backend by name (kept apart from the interface: the backends import it)."""

from __future__ import annotations

from ember.kv.transport.base import KVTransport


def make_transport(kind: str, host: str = "127.0.0.1") -> KVTransport:
    """A transport of `kind` ("mooncake" | "cuda_ipc"); `host` is where Mooncake listens."""
    # Imported here so that naming one backend never loads the other's library.
    if kind == "mooncake":
        from ember.kv.transport.mooncake import MooncakeTransport

        return MooncakeTransport(host)
    if kind == "cuda_ipc":
        from ember.kv.transport.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport()
    raise ValueError(f"unknown KV transport {kind!r} (expected 'mooncake' or 'cuda_ipc')")
