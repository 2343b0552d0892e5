"""A step as the devices of a tensor-parallel engine run it: everything the model runner decides
on the host (the flat inputs, the attention metadata's lists, which graph, which rows sample,
which prompt positions are scored), so that the other ranks run the same forward pass without
the scheduler's view of the requests (ember/engine/workers.py).

Rank 0 plans each step once (`ModelRunner.plan`), sends the plan, and every rank runs it
(`ModelRunner.run`). Lists of ints and the decode graph's staging buffers as raw bytes, in
msgpack (msgspec): no tensor is pickled on the way."""

from __future__ import annotations

import msgspec


class EagerInputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """A step outside the decode graphs: its flat inputs and attention metadata (the lists
    `ModelRunner.tensors` turns into device tensors)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    max_query_len: int
    num_decodes: int
    fed: list[int] = []
    """Flat positions whose token the previous step sampled on the device (async scheduling)."""
    fed_from: list[int] = []
    """For each of `fed`: its row in the previous step's sampled tokens."""


class GraphInputs(msgspec.Struct, array_like=True):
    """A step replayed on a decode graph: the graph and its staging buffers' used part."""

    size: int
    verifying: bool
    rows: bytes
    """int64 [6, size] (ember/engine/cuda_graphs.fill_rows)."""
    tables: bytes
    """int32 [size, width]: the block tables' used columns."""
    width: int


class StepPlan(msgspec.Struct, tag="step", array_like=True, omit_defaults=True):
    num_requests: int
    sample_at: list[int]
    """Flat rows whose logits sample, in sampling order (every verified position of a request
    with drafts)."""
    graph: GraphInputs | None = None
    eager: EagerInputs | None = None
    num_rows: int = 0
    """A graph step's rows (its logits' used part)."""
    num_sampling: int = 0
    """Requests that sample: the first rows of the next step's `prev_tokens`."""
    last_rows: list[int] = []
    """With drafts: each sampling request's last sampled row (the token the next step feeds);
    empty: the sampled rows themselves."""
    score_rows: list[int] = []
    """Prompt logprobs: the flat rows scored, their target tokens and the alternatives wanted."""
    score_targets: list[int] = []
    score_want: int = 0


class StopWorkers(msgspec.Struct, tag="stop", array_like=True):
    """The engine is closing: the workers leave their loop."""


class LoadKV(msgspec.Struct, tag="load_kv", array_like=True):
    """A decode engine reads a prompt's KV from a prefill engine: each rank reads its own heads
    of every block into its cache (ember/engine/kv_connector.py), beside the steps, and reports
    `load_id` with whether its read succeeded."""

    load_id: int
    peers: list[str]
    """The prefill engine's ranks' transport addresses."""
    remote_bases: list[int]
    """Their registered KV caches' base addresses."""
    remote_block_bytes: int
    """Bytes of one of its blocks on each of its ranks: checked against the model's layout."""
    remote_ids: list[int]
    local_ids: list[int]
    """Block ids there and here, pairwise (the blocks cached here already left out)."""
    lease_id: str = ""
    rank_tags: list[list[str]] = []
    """Over Mooncake: each prefill rank's tags of its share of the blocks, from `first` on; each
    rank checks those of the blocks it read (ember/kv/transport/block_tags.py)."""
    first: int = 0
    rank: int = -1
    """The one rank that reads (data-parallel attention: the rank the request lives on); -1:
    every rank reads its heads."""


class TagKV(msgspec.Struct, tag="tag_kv", array_like=True):
    """A prefill engine leases blocks over Mooncake: each rank with a key tags its share of them
    under it and reports the tags as `tag_id`."""

    tag_id: int
    keys: list[str]
    """Per rank: the key its tags are bound to (ember/kv/transport/block_tags.rank_lease); ""
    for a rank that holds none of the blocks (data-parallel attention: another rank's)."""
    block_ids: list[int]


class TierCopy(msgspec.Struct, tag="tier_copy", array_like=True):
    """Rank 0's KV host tier copied blocks between its cache and its host memory: every rank
    makes the same copy of its own heads, between its cache and its own host memory (the same
    slots), after what it was sent before (ember/kv/tiers/replica.py)."""

    up: bool
    """Host -> cache (a load); else cache -> host (an offload)."""
    slots: list[int]
    gpu_ids: list[int]


class TierFence(msgspec.Struct, tag="tier_fence", array_like=True):
    """The next step reads blocks just loaded, or writes blocks handed out again: each rank's
    device waits first for its tier copies still under way that touch them."""

    block_ids: list[int]


class TierPace(msgspec.Struct, tag="tier_pace", array_like=True):
    """How each rank's host tier memory grows from now on (ember/kv/tiers/host_memory.py)."""

    pace: str


class TierLower(msgspec.Struct, tag="tier_lower", array_like=True):
    """Rank 0's disk or store tier writes host slots under keys, or reads keys into host slots:
    each rank does the same with its own host memory and its own tier of that medium, then
    reports how many of the keys, from the first, it stored or found (`job_id`)."""

    job_id: int
    medium: str
    """"disk" or "store"."""
    write: bool
    keys: list[bytes]
    slots: list[int]


class TierTouch(msgspec.Struct, tag="tier_touch", array_like=True):
    """A request used these blocks: what each rank's tier of `medium` learns reuse from."""

    medium: str
    keys: list[bytes]


TierMessage = TierCopy | TierFence | TierPace | TierLower | TierTouch
Message = (
    StepPlan
    | StopWorkers
    | LoadKV
    | TagKV
    | TierCopy
    | TierFence
    | TierPace
    | TierLower
    | TierTouch
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
