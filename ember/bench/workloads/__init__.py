"""What `ember bench` sends: trace replays (Mooncake, Azure), random prompts, agent sessions."""

from ember.bench.workloads.agentic import AgenticWorkload
from ember.bench.workloads.azure import load_azure_trace
from ember.bench.workloads.mooncake import (
    ideal_cached_tokens,
    ideal_hit_ratio,
    load_mooncake_trace,
    read_mooncake_rows,
)
from ember.bench.workloads.prompts import DEFAULT_VOCAB, block_tokens
from ember.bench.workloads.random_prompts import random_workload

__all__ = [
    "DEFAULT_VOCAB",
    "AgenticWorkload",
    "block_tokens",
    "ideal_cached_tokens",
    "ideal_hit_ratio",
    "load_azure_trace",
    "load_mooncake_trace",
    "random_workload",
    "read_mooncake_rows",
]
