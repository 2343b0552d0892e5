"""The router's Prometheus metrics (its own registry): routing decisions, per-endpoint load, the
prefix cache hits it expected and the ones the engines reported, retries and failures."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter(
            "ember_router_decisions",
            "Requests routed, by path (pd, colocated) and how the endpoint was picked",
            ["path", "reason"],
            registry=r,
        )
        self.endpoint_load = Gauge(
            "ember_router_endpoint_load_tokens",
            "The router's cost of an endpoint, in tokens (queued prefill + active decode)",
            ["endpoint", "role"],
            registry=r,
        )
        self.cached_estimated = Counter(
            "ember_router_cached_tokens_estimated",
            "Prompt tokens the router expected cached where it sent them: its prefix index's "
            "match at routing time, so blocks announced by KV events it had polled; blocks a "
            "concurrent request was still computing there are not counted, though the engine "
            "may hit them by the time it runs the request",
            registry=r,
        )
        self.cached_reported = Counter(
            "ember_router_cached_tokens_reported",
            "Prompt tokens the engines reported cached (usage.prompt_tokens_details)",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "ember_router_prompt_tokens", "Prompt tokens routed", registry=r
        )
        self.retries = Counter(
            "ember_router_retries", "Legs retried on another endpoint", ["leg"], registry=r
        )
        self.failures = Counter(
            "ember_router_failures",
            "Requests that failed, by where (before the first byte, mid-stream)",
            ["stage"],
            registry=r,
        )
        self.disconnects = Counter(
            "ember_router_client_disconnects", "Clients that hung up mid-request", registry=r
        )
