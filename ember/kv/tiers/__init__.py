"""KV tiers below the GPU: host RAM, local disk and a shared store, behind one TierManager.

The names are loaded on first use (PEP 562): `ember.kv.tiers.store_master`, which `ember up` and
the server's early start import, must not pull torch in with the package (~2 s of a start)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.kv.tiers.base import BlockLayout, Medium, Tier, TierHit, TierStats
    from ember.kv.tiers.cost import CostModel
    from ember.kv.tiers.disk import DiskTier
    from ember.kv.tiers.host import HostTier
    from ember.kv.tiers.manager import TierManager

_HOMES = {
    "BlockLayout": "base",
    "Medium": "base",
    "Tier": "base",
    "TierHit": "base",
    "TierStats": "base",
    "CostModel": "cost",
    "DiskTier": "disk",
    "HostTier": "host",
    "TierManager": "manager",
}

__all__ = [
    "BlockLayout",
    "CostModel",
    "DiskTier",
    "HostTier",
    "Medium",
    "Tier",
    "TierHit",
    "TierManager",
    "TierStats",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
