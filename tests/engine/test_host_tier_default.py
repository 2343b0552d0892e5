"""The host tier's default size is one budget per process: engines in one process share it (three
`LLM`s on one GPU machine each pinning 20% of RAM were killed for memory). Its memory may start
growing before the engine has its KV cache; the tiers built later take it over."""

from __future__ import annotations

import gc

import pytest
import torch

from ember.engine import kv_tiers
from ember.engine.config import EngineConfig

GiB = 1 << 30


class FakeTier:
    """Stands in for a host tier's memory: only its lifetime matters here."""


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


def kv_cache(blocks: int = 4) -> torch.Tensor:
    return torch.zeros(blocks, 2, 2, 4, 2, 8)  # [blocks, layers, K/V, block_size, heads, dim]


BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4


def test_tiers_take_over_the_memory_started_early(tmp_path) -> None:
    config = EngineConfig(model="m", device="cpu", kv_host_gb=BLOCK_BYTES * 6 / GiB)
    cpu = torch.device("cpu")
    early = kv_tiers.start_host_memory(config, cpu, BLOCK_BYTES, 64)
    assert early is not None and early.target_rows == 6 and early.idle_ratio == 0.0
    tiers = kv_tiers.build_tiers(config, kv_cache(), "fp", 64, early)
    assert tiers is not None and tiers.host.memory is early and tiers.host.target_blocks == 6
    tiers.close()
    # Prefix caching off: no tier, and the early memory is closed, not left growing.
    off = EngineConfig(model="m", device="cpu", kv_host_gb=1, enable_prefix_caching=False)
    assert kv_tiers.start_host_memory(off, cpu, BLOCK_BYTES, 64) is None
    early = kv_tiers.start_host_memory(config, cpu, BLOCK_BYTES, 64)
    assert early is not None
    assert kv_tiers.build_tiers(off, kv_cache(), "fp", 64, early) is None
    assert early._closed
    # A lower tier that fails to open closes the memory too.
    (tmp_path / "a-file").write_text("")
    bad = EngineConfig(
        model="m",
        device="cpu",
        kv_host_gb=BLOCK_BYTES * 6 / GiB,
        kv_disk_dir=str(tmp_path / "a-file"),
    )
    early = kv_tiers.start_host_memory(bad, cpu, BLOCK_BYTES, 64)
    assert early is not None
    with pytest.raises((OSError, ValueError)):
        kv_tiers.build_tiers(bad, kv_cache(), "fp", 64, early)
    assert early._closed
    # A memory sized for other blocks is refused, and closed.
    early = kv_tiers.start_host_memory(config, cpu, BLOCK_BYTES * 2, 64)
    assert early is not None
    with pytest.raises(ValueError, match="rows of"):
        kv_tiers.build_tiers(config, kv_cache(), "fp", 64, early)
    assert early._closed
