"""Messages between the API process and the engine-core process (msgspec, msgpack on ZeroMQ)."""

from __future__ import annotations

import msgspec

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


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]
    stopped: bool = False
    """True when a stop string ended them (finished, not aborted)."""


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreInput = EngineCoreRequest | AbortRequests | Shutdown


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[list[tuple[int, float, int]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


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


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


class EngineCoreReady(msgspec.Struct, tag="ready", array_like=True):
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int


class EngineCoreFailed(msgspec.Struct, tag="failed", array_like=True):
    error: str


CoreOutput = EngineCoreOutputs | EngineCoreReady | EngineCoreFailed
