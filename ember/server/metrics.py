"""Prometheus metrics, named like vLLM's under `ember:`. Latencies are observed per request by the
serving code; load gauges and prefix-cache counters are read from the engine at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ember.engine.messages import SchedulerStats

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)


_TIER_GAUGES = (
    ("occupancy_blocks", "KV blocks the tier holds."),
    ("occupancy_bytes", "Bytes of KV the tier holds."),
    ("capacity_bytes", "Bytes of KV the tier may hold."),
)
_TIER_COUNTERS = (
    ("hits", "Blocks read out of the tier by loads."),
    (
        "misses",
        "Blocks an admitted request looked for in the tier (past its GPU hit and the tiers above) "
        "and did not find, or found corrupt on read.",
    ),
    ("blocks_in", "Blocks written into the tier."),
    ("bytes_in", "Bytes written into the tier."),
    ("blocks_out", "Blocks read out of the tier."),
    ("bytes_out", "Bytes read out of the tier."),
    ("evictions", "Blocks evicted from the tier to make room."),
    ("drops", "Blocks not written: no room, a full backlog, or a failing tier."),
    ("errors", "Tier operations that failed (an unreachable store, a disk error)."),
    ("corrupt", "Entries found truncated or corrupt on read, then recomputed."),
    ("loads", "Requests whose hit in the tier the cost model chose to load."),
    ("recomputes", "Requests whose hit in the tier the cost model chose to recompute."),
    ("prefetched", "Blocks read from the tier into host ahead of their request's admission."),
)


class _EngineCollector(Collector):
    def __init__(self, model: str, stats: Callable[[], SchedulerStats]) -> None:
        self.model = model
        self.stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats()
        labels = ["model_name"]
        for name, doc, value in (
            ("ember:num_requests_running", "Requests in the running batch.", s.num_running),
            ("ember:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("ember:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", s.kv_usage),
            (
                "ember:num_prefill_tokens_in_flight",
                "Uncomputed prompt tokens.",
                s.num_prefill_tokens,
            ),
            (
                "ember:num_decode_tokens_in_flight",
                "Context tokens of decoding requests.",
                s.num_decode_tokens,
            ),
            (
                "ember:num_kv_leases",
                "Prefill role: prompts whose KV blocks wait, leased, for a decode engine.",
                s.num_leases,
            ),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model], value)
            yield g
        g = GaugeMetricFamily(
            "ember:prefix_cache_hit_ratio",
            "Prompt tokens found cached (on the GPU or loaded from a tier) over those looked up, "
            "since start.",
            labels=labels,
        )
        g.add_metric([self.model], s.prefix_hits / max(s.prefix_queries, 1))
        yield g
        for name, doc, value in (
            (
                "ember:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_queries,
            ),
            (
                "ember:prefix_cache_hits",
                "Prompt tokens found in the prefix cache (the GPU's, and the tiers' loads).",
                s.prefix_hits,
            ),
            (
                "ember:num_preemptions",
                "Requests preempted for lack of KV blocks.",
                s.num_preemptions,
            ),
            (
                "ember:kv_lease_expiries",
                "Prefill role: leases that expired before a decode engine read them.",
                s.lease_expiries,
            ),
            (
                "ember:remote_kv_loads",
                "Decode role: prompts whose KV was read from a prefill engine.",
                s.remote_kv_loads,
            ),
            (
                "ember:remote_kv_failures",
                "Decode role: KV reads that failed, so the prompt was prefilled locally.",
                s.remote_kv_failures,
            ),
            # Speculative decoding, vLLM's `spec_decode_*` counters (zero while it is off).
            (
                "ember:spec_decode_num_drafts",
                "Verifications of a request that carried at least one draft token.",
                s.spec_drafts,
            ),
            ("ember:spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_draft_tokens),
            (
                "ember:spec_decode_num_accepted_tokens",
                "Draft tokens accepted by verification.",
                s.spec_accepted_tokens,
            ),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.model], value)
            yield c
        yield from self._tier_metrics(s)
        yield from self._spec_metrics(s)
        if s.expert_load:
            c = CounterMetricFamily(
                "ember:expert_load_tokens",
                "Expert parallel: (token, expert) pairs routed to each rank's experts, over "
                "every MoE layer.",
                labels=[*labels, "rank"],
            )
            for rank, value in enumerate(s.expert_load):
                c.add_metric([self.model, str(rank)], value)
            yield c

    def _tier_metrics(self, s: SchedulerStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """`ember:kv_tier_*{medium=cpu|disk|store}` from the KV tiers' counters."""
        if not s.kv_tiers:
            return
        labels = ["model_name", "medium"]
        for field, doc in _TIER_GAUGES:
            g = GaugeMetricFamily(f"ember:kv_tier_{field}", doc, labels=labels)
            for medium, t in s.kv_tiers.items():
                g.add_metric([self.model, medium], getattr(t, field))
            yield g
        g = GaugeMetricFamily(
            "ember:kv_tier_load_bytes_per_second",
            "Measured load speed of the tier (host -> GPU for cpu, to host for the others).",
            labels=labels,
        )
        for medium, bw in s.kv_tier_bandwidth.items():
            g.add_metric([self.model, medium], bw)
        yield g
        g = GaugeMetricFamily(
            "ember:prefill_tokens_per_second",
            "Measured prefill speed the tiers' cost model weighs loads against.",
            labels=["model_name"],
        )
        g.add_metric([self.model], s.prefill_tok_s)
        yield g
        g = GaugeMetricFamily(
            "ember:kv_tier_hit_ratio",
            "Hits over hits and misses of the tier since start (0 before any lookup).",
            labels=labels,
        )
        for medium, t in s.kv_tiers.items():
            g.add_metric([self.model, medium], t.hits / max(t.hits + t.misses, 1))
        yield g
        for field, doc in _TIER_COUNTERS:
            c = CounterMetricFamily(f"ember:kv_tier_{field}", doc, labels=labels)
            for medium, t in s.kv_tiers.items():
                c.add_metric([self.model, medium], getattr(t, field))
            yield c

    def _spec_metrics(self, s: SchedulerStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Speculative decoding beyond the plain counters (in `collect`): acceptance per draft
        position, and the mean accepted length since start once a draft has been verified."""
        c = CounterMetricFamily(
            "ember:spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position (0-based) was accepted.",
            labels=["model_name", "position"],
        )
        for pos, accepted in enumerate(s.spec_accepted_per_pos):
            c.add_metric([self.model, str(pos)], accepted)
        yield c
        if s.spec_drafts:
            # Since start; a window's is 1 + rate(accepted_tokens) / rate(num_drafts).
            g = GaugeMetricFamily(
                "ember:spec_decode_mean_accepted_length",
                "Tokens a verification step yields per draft, since start: 1 + accepted / drafts.",
                labels=["model_name"],
            )
            g.add_metric([self.model], 1.0 + s.spec_accepted_tokens / s.spec_drafts)
            yield g


class ServerMetrics:
    def __init__(self, model: str, stats: Callable[[], SchedulerStats]) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram(
            "ember:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model)
        self.itl = Histogram(
            "ember:inter_token_latency_seconds",
            "Time between output tokens.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model)
        self.e2e = Histogram(
            "ember:e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model)
        self.prompt_tokens = Counter(
            "ember:prompt_tokens", "Prompt tokens processed.", labels, registry=r
        ).labels(model)
        self.generation_tokens = Counter(
            "ember:generation_tokens", "Tokens generated.", labels, registry=r
        ).labels(model)
        self._success = Counter(
            "ember:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        r.register(_EngineCollector(model, stats))

    def request_finished(self, finish_reason: str) -> None:
        self._success.labels(self.model, finish_reason).inc()
