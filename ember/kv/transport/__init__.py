"""ember.kv.transport: moves KV-cache blocks between processes (shared memory, CUDA IPC, Mooncake TE)."""

from ember.kv.transport.base import KVTransport, TransferError
from ember.kv.transport.factory import KINDS, make_transport, resolve_kind
from ember.kv.transport.layout import ShardLayout, block_regions, pair_regions

__all__ = [
    "KINDS",
    "KVTransport",
    "ShardLayout",
    "TransferError",
    "block_regions",
    "make_transport",
    "pair_regions",
    "resolve_kind",
]
