"""ember.kv.transport: moves KV-cache blocks between processes (Mooncake TE, CUDA IPC)."""

from ember.kv.transport.base import KVTransport, TransferError
from ember.kv.transport.factory import make_transport
from ember.kv.transport.layout import block_regions, pair_regions

__all__ = ["KVTransport", "TransferError", "block_regions", "make_transport", "pair_regions"]
