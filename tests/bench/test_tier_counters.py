"""`ember bench`'s server-counted KV hits: the prefix cache's and each tier's counters read from
/metrics before and after a run, their difference in the report."""

from __future__ import annotations

from ember.bench.report import _tier_lines
from ember.bench.tier_counters import TierCounters, parse_tier_counters, tier_summary

EXPOSITION = """\
# HELP ember:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE ember:prefix_cache_queries_total counter
ember:prefix_cache_queries_total{model_name="m"} %(q)s
# HELP ember:prefix_cache_hits_total Prompt tokens found.
# TYPE ember:prefix_cache_hits_total counter
ember:prefix_cache_hits_total{model_name="m"} %(h)s
# HELP ember:kv_tier_hits_total Blocks read out of the tier by loads.
# TYPE ember:kv_tier_hits_total counter
ember:kv_tier_hits_total{medium="cpu",model_name="m"} %(ch)s
ember:kv_tier_hits_total{medium="disk",model_name="m"} 0.0
# HELP ember:kv_tier_misses_total Blocks looked for and not found.
# TYPE ember:kv_tier_misses_total counter
ember:kv_tier_misses_total{medium="cpu",model_name="m"} %(cm)s
ember:kv_tier_misses_total{medium="disk",model_name="m"} %(cm)s
# HELP ember:num_requests_running Requests in the running batch.
# TYPE ember:num_requests_running gauge
ember:num_requests_running{model_name="m"} 3.0
"""


def counters(q: float, h: float, ch: float, cm: float) -> TierCounters:
    parsed = parse_tier_counters(EXPOSITION % {"q": q, "h": h, "ch": ch, "cm": cm})
    assert parsed is not None
    return parsed


def test_a_runs_hits_are_the_counters_difference() -> None:
    before, after = counters(1000, 200, 5, 10), counters(5000, 3200, 65, 30)
    delta = after.since(before)
    assert delta is not None
    s = tier_summary(delta)
    assert (s["prefix_queries"], s["prefix_hits"]) == (4000, 3000)
    assert s["prefix_hit_ratio"] == 0.75
    assert s["tiers"]["cpu"] == {"hits": 60, "misses": 20, "hit_ratio": 0.75}
    assert s["tiers"]["disk"] == {"hits": 0, "misses": 20, "hit_ratio": 0.0}
    [line] = _tier_lines(s)
    assert "75.0% of 4000 prompt tokens" in line and "host 75.0% of 80 blocks" in line
    assert after.since(counters(9000, 0, 0, 0)) is None  # went back: a restart
    # Two engines behind a router: summed.
    both = counters(10, 5, 1, 1) + counters(30, 15, 3, 3)
    assert (both.queries, both.hits, both.tiers) == (40, 20, (("cpu", 4, 4), ("disk", 0, 4)))


def test_a_server_without_the_counters_reports_nothing() -> None:
    assert parse_tier_counters('vllm:num_requests_running{model_name="m"} 1.0\n') is None
    assert parse_tier_counters("not prometheus {{{") is None
    assert _tier_lines(None) == []
