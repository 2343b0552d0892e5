"""What every KV tier shares: the block layout it stores, the lower-tier interface, its counters.

A tier stores whole KV blocks, each one contiguous run of `BlockLayout.nbytes` bytes (the KV cache is
block-major), keyed by the block's chained hash (`ember.kv.block_hash`, 32 bytes).
"""

from __future__ import annotations

import hashlib
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from ember.kv.tiers.host_memory import HostMemory

Medium = Literal["gpu", "cpu", "disk", "store"]


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype named without its prefix ("bfloat16", "float32")."""
    import torch  # here: the API process imports this module (TierStats) and no torch

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {dtype!r}")
    return torch.empty((), dtype=torch_dtype).element_size()


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The shape of one KV block; two engines may share a block only if their layouts are equal."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    model: str  # a fingerprint of the model (config and weight files), never a path
    kv_planes: int = 2  # K and V; 1 for MLA's latent vector (ModelConfig.kv_cache_dims)

    def __post_init__(self) -> None:
        if self.kv_planes not in (1, 2):
            raise ValueError(f"BlockLayout.kv_planes must be 1 or 2, got {self.kv_planes}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"BlockLayout.{name} must be > 0, got {getattr(self, name)}")
        dtype_itemsize(self.dtype)

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of one block: K and V (or MLA's latent) of every layer."""
        dims = (self.num_layers, self.kv_planes, self.block_size, self.num_kv_heads, self.head_dim)
        return math.prod(dims) * self.itemsize

    def fingerprint(self) -> str:
        """Hex digest of every field; written into disk entries and store keys."""
        # kv_planes joined the fields later: left out at its default, K/V layouts keep the
        # fingerprints their disk entries and store keys were written under.
        text = "|".join(
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if not (f.name == "kv_planes" and self.kv_planes == 2)
        )
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    @classmethod
    def from_kv_cache(cls, kv_cache: torch.Tensor, model: str) -> BlockLayout:
        """The layout of a block-major cache `[num_blocks, layers, planes, block_size, heads,
        dim]` (planes: 2 for K and V, 1 for MLA's latent)."""
        if kv_cache.dim() != 6 or kv_cache.shape[2] not in (1, 2):
            raise ValueError(f"expected a block-major KV cache, got shape {tuple(kv_cache.shape)}")
        _, layers, planes, block_size, heads, dim = kv_cache.shape
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        return cls(layers, heads, dim, block_size, dtype, model, planes)


@dataclass(slots=True)
class TierStats:
    """Counters of one tier since it started; `stats()` hands out copies."""

    hits: int = 0  # blocks found by lookups / reads
    misses: int = 0  # blocks asked for and not found (or found corrupt)
    blocks_in: int = 0  # blocks written into this tier
    bytes_in: int = 0
    blocks_out: int = 0  # blocks read out of this tier
    bytes_out: int = 0
    evictions: int = 0
    occupancy_blocks: int = 0
    occupancy_bytes: int = 0
    capacity_bytes: int = 0
    drops: int = 0  # writes not done: queue full, no room, or the tier failed
    errors: int = 0  # operations that raised (an unreachable store, a disk error)
    corrupt: int = 0  # entries found truncated or corrupt on read (then deleted)
    loads: int = 0  # cost-model decisions to load from this tier
    recomputes: int = 0  # cost-model decisions to recompute rather than load
    prefetched: int = 0  # blocks read from this tier into host ahead of their request's admission

    def copy(self) -> TierStats:
        return TierStats(**{f.name: getattr(self, f.name) for f in fields(self)})


class Counters:
    """Counters the tier manager keeps per medium (drops, errors, decisions), added to each
    tier's own; thread-safe."""

    def __init__(self, media: Sequence[Medium]) -> None:
        self._lock = threading.Lock()
        self._by_medium: dict[Medium, TierStats] = {m: TierStats() for m in media}

    def has(self, medium: Medium) -> bool:
        return medium in self._by_medium

    def add(self, medium: Medium, **deltas: int) -> None:
        with self._lock:
            s = self._by_medium[medium]
            for name, delta in deltas.items():
                setattr(s, name, getattr(s, name) + delta)

    def merged(self, medium: Medium, own: TierStats) -> TierStats:
        """The tier's own counters plus these."""
        with self._lock:
            extra = self._by_medium[medium]
            for f in fields(TierStats):
                setattr(own, f.name, getattr(own, f.name) + getattr(extra, f.name))
        return own


TierEvent = tuple[str, bytes, Medium]
"""("stored" | "removed", block hash, medium): what the router's prefix index follows."""


class EventLog:
    """A tier's KV events since the last drain, kept only while `enabled`; thread-safe."""

    def __init__(self, medium: Medium) -> None:
        self.medium = medium
        self.enabled = False
        self._lock = threading.Lock()
        self._events: list[TierEvent] = []

    def record(self, kind: str, keys: Sequence[bytes]) -> None:
        if self.enabled and keys:
            with self._lock:
                self._events.extend((kind, k, self.medium) for k in keys)

    def drain(self) -> list[TierEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out


@dataclass(frozen=True, slots=True)
class TierHit:
    """The longest prefix of a key list found below the GPU, split by the tier that holds it.

    The prefix is host blocks first, then disk blocks, then store blocks (each tier continues where
    the one above stopped).
    """

    host: int = 0
    disk: int = 0
    store: int = 0

    @property
    def num_blocks(self) -> int:
        return self.host + self.disk + self.store

    def by_medium(self) -> dict[Medium, int]:
        return {"cpu": self.host, "disk": self.disk, "store": self.store}


def leading(found: Sequence[bool]) -> int:
    """How many of `found`, from the first, are True."""
    n = 0
    for ok in found:
        if not ok:
            break
        n += 1
    return n


def check_rows(t: torch.Tensor, n: int, nbytes: int, what: str) -> None:
    """Raise unless `t` is a CPU uint8 tensor of shape [n, nbytes] (contiguous rows)."""
    import torch

    if t.dtype != torch.uint8 or t.device.type != "cpu":
        raise ValueError(f"{what} must be a CPU uint8 tensor, got {t.dtype} on {t.device}")
    if tuple(t.shape) != (n, nbytes):
        raise ValueError(f"{what} must have shape ({n}, {nbytes}), got {tuple(t.shape)}")
    if n and t.stride(1) != 1:
        raise ValueError(f"{what} rows must be contiguous")


class Tier(ABC):
    """A lower tier (disk, store): blocks keyed by hash, moved through CPU buffers.

    The tier manager calls `put` / `get_into` (and the `_rows` forms) from its one background
    thread, one call at a time, and `contains_prefix` also from the engine thread at scheduling:
    that one must be thread-safe and quick, unless `lookup_may_wait`. A missing or unreadable entry
    is a miss, never an exception; an exception (an unreachable store) is caught by the manager and
    counted as a miss.
    """

    medium: Medium
    lookup_may_wait: bool = False
    """True where a lookup may wait on a network (the store): the manager then asks `present` in
    a background thread as soon as a request arrives, never the engine thread at scheduling."""

    @abstractmethod
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first on and in order, are present."""

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of `keys` is present, wherever a gap falls; the default answers from
        `contains_prefix` (False from the first gap on)."""
        n = self.contains_prefix(keys)
        return [i < n for i in range(len(keys))]

    @abstractmethod
    def put(self, keys: Sequence[bytes], src: torch.Tensor) -> list[bool]:
        """Store row i of `src` (uint8 [len(keys), nbytes], CPU) under keys[i]; True where stored."""

    @abstractmethod
    def get_into(self, keys: Sequence[bytes], dst: torch.Tensor) -> list[bool]:
        """Read keys[i] into row i of `dst` (uint8 [len(keys), nbytes], CPU); False where missing."""

    def put_rows(
        self, keys: Sequence[bytes], memory: HostMemory, slots: Sequence[int]
    ) -> list[bool]:
        """Store the host tier's row `slots[i]` under keys[i]. A tier that registers memory (the
        store) may override this to move the rows in place; the default gathers them and calls
        `put`."""
        if not keys:
            return []
        import torch

        return self.put(keys, torch.stack([memory.row(s) for s in slots]))

    def get_into_rows(
        self, keys: Sequence[bytes], memory: HostMemory, slots: Sequence[int]
    ) -> list[bool]:
        """Read keys[i] into the host tier's row `slots[i]` (see `put_rows`); the default reads
        into a gathered copy and scatters the rows it found."""
        if not keys:
            return []
        import torch

        staging = torch.empty((len(keys), memory.row_bytes), dtype=torch.uint8)
        found = self.get_into(keys, staging)
        for i, ok in enumerate(found):
            if ok:
                memory.row(slots[i]).copy_(staging[i])
        return found

    def touch(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - optional: the store evicts by its own rules
        """A request that ended used these blocks (in prompt order): what a tier that chooses
        its own victims learns reuse from (ember/kv/eviction.py); the default ignores it."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A copy of this tier's counters."""

    def close(self) -> None:  # noqa: B027 - optional: most tiers hold nothing to release
        """Release files, connections and buffers; the default holds none."""
