"""The cost model: load only when moving the bytes beats prefilling the tokens."""

from __future__ import annotations

import pytest

from ember.kv.tiers.base import BlockLayout, TierHit
from ember.kv.tiers.cost import DEFAULT_BANDWIDTH, CostModel

LAYOUT = BlockLayout(
    num_layers=8, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16", model="m"
)
MB = LAYOUT.nbytes  # bandwidths below are in blocks per second, so the arithmetic is plain


def model(**kw: object) -> CostModel:
    return CostModel(
        LAYOUT,
        bandwidth={"cpu": 10 * MB, "disk": 2 * MB, "store": 1 * MB},
        latency={"cpu": 0.0, "disk": 0.5, "store": 1.0},
        **kw,  # type: ignore[arg-type]
    )


def test_load_seconds_adds_each_tier_read_and_one_host_to_gpu_copy() -> None:
    cost = model()
    assert cost.load_seconds(TierHit()) == 0.0
    assert cost.load_seconds(TierHit(host=10)) == pytest.approx(1.0)
    # 4 disk blocks: 0.5 s latency + 2 s read, then 0.4 s to the GPU.
    assert cost.load_seconds(TierHit(disk=4)) == pytest.approx(2.9)
    assert cost.load_seconds(TierHit(host=1, disk=2, store=3)) == pytest.approx(
        0.6 + (0.5 + 1.0) + (1.0 + 3.0)
    )


def test_should_load_compares_with_recomputing_the_tokens() -> None:
    cost = model()
    hit = TierHit(host=10)  # 1 s to load, 160 tokens
    assert cost.should_load(hit, prefill_tok_s=100.0)  # 1.6 s to recompute
    assert not cost.should_load(hit, prefill_tok_s=1000.0)  # 0.16 s
    assert not cost.should_load(TierHit(), prefill_tok_s=1.0)


def test_prefill_speed_is_measured_by_the_engine() -> None:
    cost = model(prefill_tok_s=1e9)
    hit = TierHit(host=10)
    assert not cost.should_load(hit)
    cost.observe_prefill(tokens=100, seconds=1.0)  # the first measure replaces the default
    assert cost.prefill_tok_s == pytest.approx(100.0)
    assert cost.should_load(hit)


def test_bandwidth_is_an_ewma_from_a_conservative_default() -> None:
    cost = CostModel(LAYOUT, alpha=0.5)
    assert cost.bandwidth("disk") == DEFAULT_BANDWIDTH["disk"]
    cost.observe_load("disk", 4 * MB, 1.0)
    assert cost.bandwidth("disk") == pytest.approx(4 * MB)
    cost.observe_load("disk", 2 * MB, 1.0)
    assert cost.bandwidth("disk") == pytest.approx(3 * MB)
    cost.observe_load("disk", 0, 1.0)  # nothing moved: no measure
    assert cost.bandwidth("disk") == pytest.approx(3 * MB)
    assert cost.bandwidth("store") == DEFAULT_BANDWIDTH["store"]


def test_plan_keeps_the_profitable_prefix() -> None:
    cost = model()
    hit = TierHit(host=10, disk=0, store=10)
    # At 100 tok/s: host alone loads in 1 s against 1.6 s of prefill; all of it in 13 s against 3.2.
    assert cost.plan(hit, prefill_tok_s=100.0) == TierHit(host=10)
    # Very slow prefill: everything is worth loading.
    assert cost.plan(hit, prefill_tok_s=1.0) == hit
    assert cost.plan(hit, prefill_tok_s=1e9) == TierHit()


def test_a_hit_is_never_slower_than_a_miss() -> None:
    cost = model()
    for host in range(0, 20, 3):
        for disk in range(0, 20, 4):
            for speed in (10.0, 100.0, 1000.0, 1e5):
                hit = TierHit(host=host, disk=disk)
                chosen = cost.plan(hit, speed)
                assert cost.load_seconds(chosen) <= cost.recompute_seconds(chosen.num_blocks, speed)
                if cost.should_load(hit, speed):
                    assert cost.load_seconds(hit) < cost.recompute_seconds(hit.num_blocks, speed)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="alpha"):
        CostModel(LAYOUT, alpha=0.0)
    with pytest.raises(ValueError, match="prefill_tok_s"):
        CostModel(LAYOUT, prefill_tok_s=0.0)
