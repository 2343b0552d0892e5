"""Pick a KV transport backend by name (kept apart from the interface: the backends import it)."""

from __future__ import annotations

from ember.kv.transport.base import KVTransport

KINDS = ("auto", "shm", "cuda_ipc", "mooncake")
"""`--kv-transport` values. auto: the engines of one host move KV without a network port (shm on
the CPU, cuda_ipc on GPUs); mooncake, the only one that crosses hosts, listens on `--kv-host`."""


def resolve_kind(kind: str, device: str) -> str:
    """The transport `kind` names on `device` ("auto" resolved)."""
    if kind == "auto":
        return "cuda_ipc" if device.startswith("cuda") else "shm"
    if kind not in KINDS:
        raise ValueError(f"unknown KV transport {kind!r} (expected one of {', '.join(KINDS)})")
    return kind


def make_transport(kind: str, host: str = "127.0.0.1", timeout_s: float = 30.0) -> KVTransport:
    """A transport of `kind` ("shm" | "cuda_ipc" | "mooncake", resolved); `host` is where
    Mooncake listens, and `timeout_s` bounds one of its transfers (plus 1 s a GiB)."""
    # Imported here so that naming one backend never loads the other's library.
    if kind == "mooncake":
        from ember.kv.transport.mooncake import MooncakeTransport

        return MooncakeTransport(host, timeout_s=timeout_s)
    if kind == "cuda_ipc":
        from ember.kv.transport.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport()
    if kind == "shm":
        from ember.kv.transport.shared_memory import SharedMemoryTransport

        return SharedMemoryTransport()
    raise ValueError(f"unknown KV transport {kind!r} (expected 'shm', 'cuda_ipc' or 'mooncake')")
