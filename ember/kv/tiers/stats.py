"""A tier's counters, torch-free: the engine core's messages carry them to the API process, which
does not import torch (`ember serve` starts faster without it: ember/engine/core_spawn.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields


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
