"""The KV cache's hits as the server counts them: ember's prefix-cache counters (prompt tokens looked
up, and found on the GPU or loaded from a tier) and each KV tier's hits and misses (blocks), read
from its /metrics before and after a run, their difference summed over the servers.

The client's own figure (`cache_hit_ratio`, from each answer's `cached_tokens`) says how much of
the prompts was cached; these say where: how much a tier held of what the GPU did not, which is
what a tier's size and eviction decide. A server without the counters (vLLM, a router) reports
nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ember.bench.spec_counters import CounterProbe

PREFIX_QUERIES = "ember:prefix_cache_queries"
PREFIX_HITS = "ember:prefix_cache_hits"
TIER_HITS = "ember:kv_tier_hits"
TIER_MISSES = "ember:kv_tier_misses"
SCOPE = "the server's counters over the run (after minus before), summed over its engines"


@dataclass(frozen=True, slots=True)
class TierCounters:
    """Cumulative counts: prompt tokens looked up and hit; per tier (medium), blocks hit and
    missed."""

    queries: float = 0.0
    hits: float = 0.0
    tiers: tuple[tuple[str, float, float], ...] = ()

    def __add__(self, other: TierCounters) -> TierCounters:
        return TierCounters(
            self.queries + other.queries, self.hits + other.hits, _merge(self.tiers, other.tiers, 1)
        )

    def since(self, before: TierCounters) -> TierCounters | None:
        """What was counted after `before`; None if a counter went back (a server restarted)."""
        delta = TierCounters(
            self.queries - before.queries,
            self.hits - before.hits,
            _merge(self.tiers, before.tiers, -1),
        )
        values = [delta.queries, delta.hits] + [v for _, h, m in delta.tiers for v in (h, m)]
        return None if any(v < 0 for v in values) else delta


def _merge(
    a: tuple[tuple[str, float, float], ...], b: tuple[tuple[str, float, float], ...], sign: int
) -> tuple[tuple[str, float, float], ...]:
    out: dict[str, list[float]] = {m: [h, s] for m, h, s in a}
    for m, h, s in b:
        row = out.setdefault(m, [0.0, 0.0])
        row[0] += sign * h
        row[1] += sign * s
    return tuple((m, h, s) for m, (h, s) in sorted(out.items()))


def parse_tier_counters(text: str) -> TierCounters | None:
    """The counters in a Prometheus text exposition; None when it has no prefix-cache counters
    (or is not Prometheus text)."""
    totals: dict[str, float] = {}
    tiers: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.type != "counter" or family.name not in (
                PREFIX_QUERIES,
                PREFIX_HITS,
                TIER_HITS,
                TIER_MISSES,
            ):
                continue
            for s in family.samples:
                if not s.name.endswith("_total"):
                    continue
                if family.name in (TIER_HITS, TIER_MISSES):
                    row = tiers.setdefault(s.labels["medium"], [0.0, 0.0])
                    row[family.name == TIER_MISSES] += s.value
                else:
                    totals[family.name] = totals.get(family.name, 0.0) + s.value
    except (ValueError, KeyError, IndexError):
        return None
    if PREFIX_QUERIES not in totals:
        return None
    return TierCounters(
        totals[PREFIX_QUERIES],
        totals.get(PREFIX_HITS, 0.0),
        tuple((m, h, s) for m, (h, s) in sorted(tiers.items())),
    )


def tier_summary(delta: TierCounters) -> dict[str, Any]:
    """A run's counts for the report: the prefix cache's hit ratio in tokens, and each tier's in
    blocks (hits over hits and misses; None where it was never asked)."""
    return {
        "scope": SCOPE,
        "prefix_queries": round(delta.queries),
        "prefix_hits": round(delta.hits),
        "prefix_hit_ratio": delta.hits / delta.queries if delta.queries else None,
        "tiers": {
            medium: {
                "hits": round(h),
                "misses": round(m),
                "hit_ratio": h / (h + m) if h + m else None,
            }
            for medium, h, m in delta.tiers
        },
    }


class TierProbe(CounterProbe[TierCounters]):
    """The prefix cache's and the KV tiers' counters over a run (`tier_summary`)."""

    what = "the KV tiers' hits"

    def parse(self, text: str) -> TierCounters | None:
        return parse_tier_counters(text)

    def summary(self, delta: TierCounters) -> dict[str, Any]:
        return tier_summary(delta)
