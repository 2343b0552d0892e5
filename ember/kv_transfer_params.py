"""KVTransferParams: what a request and its answer carry for prefill/decode disaggregation, a
public field of both (`kv_transfer_params`), so it lives beside SamplingParams and the outputs,
below the engine."""

from __future__ import annotations

import msgspec


class KVTransferParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Prefill/decode disaggregation, vLLM's `kv_transfer_params` in shape.

    To a prefill engine a request brings `do_remote_decode`; its answer carries the rest (where the
    prompt's KV blocks are, under which lease, and the first token). A decode engine gets that
    answer back with `do_remote_prefill`, reads the blocks, releases the lease and decodes on.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    engine_id: str = ""
    lease_id: str = ""
    block_ids: list[int] = msgspec.field(default_factory=list)
    transfer_address: str = ""
    """The prefill engine's KV transport address ("host:port" for Mooncake)."""
    kv_base_addr: int = 0
    """Address of the prefill engine's registered KV cache; block i starts at base + i * block_bytes."""
    block_bytes: int = 0
    """Bytes of a block on each rank of the prefill engine (its heads' share of the KV)."""
    rank_transfer_addresses: list[str] = msgspec.field(default_factory=list)
    """A tensor-parallel prefill engine's ranks 1 .. N-1: each one's transport address (rank 0's
    is `transfer_address`); each rank holds its heads of every block."""
    rank_kv_base_addrs: list[int] = msgspec.field(default_factory=list)
    """Those ranks' registered KV caches' addresses, as `kv_base_addr` is rank 0's."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_id: int = -1
    lease_s: float = 0.0
    """Seconds the prefill engine holds the blocks unless released first."""
    release_url: str = ""
    """Where the decode side POSTs {"lease_id": ...} once it has read the blocks."""
    block_tags: list[str] = msgspec.field(default_factory=list)
    """Over a transport that peers reach by network (Mooncake): each block's keyed tag
    (ember/kv/transport/block_tags.py), checked by the decode engine before it uses the block."""
    rank_block_tags: list[list[str]] = msgspec.field(default_factory=list)
    """A tensor-parallel prefill engine's ranks 1 .. N-1: each one's tags of its share of the
    blocks (rank 0's are `block_tags`)."""
    signature: str = ""
    """HMAC of the other fields under the cluster secret, set by the prefill engine's API process
    (ember.trust.sign_kv_params): a decode engine reads only KV that a peer really offered."""

    @property
    def peers(self) -> list[str]:
        """Every rank's transport address, rank 0's first."""
        return [self.transfer_address, *self.rank_transfer_addresses]

    @property
    def all_block_tags(self) -> list[list[str]]:
        """Every rank's block tags, rank 0's first; empty without tags."""
        return [self.block_tags, *self.rank_block_tags] if self.block_tags else []

    @property
    def kv_base_addrs(self) -> list[int]:
        """Every rank's KV cache address, rank 0's first."""
        return [self.kv_base_addr, *self.rank_kv_base_addrs]
