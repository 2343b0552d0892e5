"""KV tiers below the GPU: host RAM, local disk and a shared store, behind one TierManager."""

from ember.kv.tiers.base import BlockLayout, Medium, Tier, TierHit, TierStats
from ember.kv.tiers.cost import CostModel
from ember.kv.tiers.disk import DiskTier
from ember.kv.tiers.host import HostTier
from ember.kv.tiers.manager import TierManager

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
