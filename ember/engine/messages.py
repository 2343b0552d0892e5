"""Messages between the API process and the engine-core process (msgspec, msgpack on ZeroMQ)."""

from __future__ import annotations

import msgspec

from ember.kv.tiers.base import TierStats
from ember.kv_transfer_params import KVTransferParams
from ember.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    """One sample of one request, tokenized and validated; the core makes a Request of it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int
    seed: int | None = None
    """This sample's own seed (a request's seed + its index among the n samples)."""
    cache_salt: str | None = None
    arrival_time: float = 0.0
    kv_transfer: KVTransferParams | None = None


class ReleaseLease(msgspec.Struct, tag="release", array_like=True):
    lease_id: str


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]
    stopped: bool = False
    """True when a stop string ended them (finished, not aborted)."""


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreInput = EngineCoreRequest | AbortRequests | ReleaseLease | Shutdown


TokenLogprobs = list[tuple[int, float, int]]
"""One position's logprobs: (token id, logprob, rank), the sampled or scored token first, then the
top alternatives (rank 1, 2, ...)."""


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    """Set on a prefill-role request's last output: where its KV waits for the decode side."""
    lease_until: float = 0.0
    """With kv_transfer_params: when the core will let the lease expire (time.monotonic(), the
    system-wide clock both processes read), so the API process can answer a release itself."""
    spec_draft_tokens: int = 0
    """Speculative decoding: the request's draft tokens verified so far (cumulative, so the last
    output seen has the totals), and how many of them were accepted."""
    spec_accepted_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With SamplingParams.prompt_logprobs, on the output of the step that ends the prompt: entry p
    scores prompt token p + 1 (the first token has no entry)."""


class SchedulerStats(msgspec.Struct, array_like=True):
    """What the router and /load need to know about the core's load."""

    num_running: int = 0
    num_waiting: int = 0
    num_prefill_tokens: int = 0
    """Uncomputed prompt tokens of waiting and partially prefilled requests."""
    num_decode_tokens: int = 0
    """Context tokens of requests that are decoding."""
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_leases: int = 0
    """Prefill role: requests whose KV blocks wait, leased, for a decode engine to read them."""
    lease_expiries: int = 0
    remote_kv_loads: int = 0
    """Decode role: prompts whose KV was read from a prefill engine."""
    remote_kv_failures: int = 0
    """Decode role: reads that failed, so the prompt was prefilled here instead."""
    remote_kv_bytes: int = 0
    remote_kv_seconds: float = 0.0
    """Decode role: bytes read from prefill engines, and the wall time the reads took."""
    kv_tiers: dict[str, TierStats] = msgspec.field(default_factory=dict)
    """The KV tiers' counters by medium ("cpu", "disk", "store"); empty when none is on."""
    kv_tier_bandwidth: dict[str, float] = msgspec.field(default_factory=dict)
    """The cost model's measured load speed by medium, bytes/s (host -> GPU for "cpu")."""
    prefill_tok_s: float = 0.0
    """The cost model's measured prefill speed (0 without tiers)."""
    spec_drafts: int = 0
    """Speculative decoding, since start: verifications of a request with at least one draft."""
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    """Entry i: drafts whose token at position i (0-based) was accepted."""
    expert_load: list[int] = msgspec.field(default_factory=list)
    """Expert parallel: entry r, the (token, expert) pairs routed to rank r's experts so far
    (every MoE layer; a few seconds stale at most); empty otherwise."""


class KVEvents(msgspec.Struct, array_like=True):
    """Block hashes stored in and removed from a KV medium since the last message, in order:
    (kind, hash, medium), medium "gpu" for the prefix cache, "cpu" / "disk" for the tiers below
    it (as vLLM's KV events carry a medium)."""

    events: list[tuple[str, bytes, str]]


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    kv_events: KVEvents | None = None
    lease_replies: list[tuple[str, bool]] | None = None
    """Answers to ReleaseLease: (lease id, whether it was still held)."""


class EngineCoreReady(msgspec.Struct, tag="ready", array_like=True):
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    engine_id: str = ""
    kv_root_hash: bytes = b""
    """Parent hash of every sequence's first block: the router hashes prompts the same way."""
    transfer_address: str = ""


class EngineCoreFailed(msgspec.Struct, tag="failed", array_like=True):
    error: str


CoreOutput = EngineCoreOutputs | EngineCoreReady | EngineCoreFailed
