"""The host tier's default size is one budget per process: engines in one process share it (three
`LLM`s on one GPU machine each pinning 20% of RAM were killed for memory)."""

from __future__ import annotations

import gc

import pytest
import torch

from ember.engine import kv_tiers
from ember.engine.config import EngineConfig

GiB = 1 << 30


class FakeTier:
    """Stands in for a HostTier: only its lifetime matters here."""


def test_default_host_tiers_share_one_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_tiers, "physical_memory_bytes", lambda: 100 * GiB)
    monkeypatch.setattr(kv_tiers, "_default_claims", {})
    cuda = torch.device("cuda", 0)
    default = EngineConfig(model="m")
    assert kv_tiers.host_tier_bytes(default, cuda) == 20 * GiB
    first = FakeTier()
    kv_tiers._claim_default(default, first, 15 * GiB)
    assert kv_tiers.host_tier_bytes(default, cuda) == 5 * GiB  # what the first left
    second = FakeTier()
    kv_tiers._claim_default(default, second, 5 * GiB)
    assert kv_tiers.host_tier_bytes(default, cuda) == 0  # nothing left: off
    # An explicit size is the user's call, never shared out.
    assert kv_tiers.host_tier_bytes(EngineConfig(model="m", kv_host_gb=8), cuda) == 8 * GiB
    kv_tiers._claim_default(EngineConfig(model="m", kv_host_gb=8), FakeTier(), 8 * GiB)
    del first
    gc.collect()
    assert kv_tiers.host_tier_bytes(default, cuda) == 15 * GiB  # a collected tier gives back
    assert kv_tiers.host_tier_bytes(default, torch.device("cpu")) == 0
    del second
