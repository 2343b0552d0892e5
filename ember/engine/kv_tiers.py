"""The engine's side of the KV tiers (ember/kv/tiers): the model fingerprint that names a block the
same on every node, and the TierManager built from the engine's settings."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ember.engine.step_plan import TierCopy, TierFence, TierLower, TierPace, TierTouch
from ember.kv.tiers import BlockLayout, CostModel, DiskTier, HostTier, Tier, TierManager
from ember.kv.tiers.host_memory import HostMemory, Pace
from ember.kv.tiers.replica import (
    Ack,
    HostReplica,
    LowerChannel,
    LowerReplica,
    Replicas,
    ShardedTier,
)
from ember.models.checkpoint_files import safetensors_files

if TYPE_CHECKING:
    from ember.engine.config import EngineConfig
    from ember.engine.model_runner import PendingStep
    from ember.engine.scheduler import SchedulerOutput
    from ember.engine.workers import Workers

log = logging.getLogger(__name__)

GiB = 1 << 30
HOST_TIER_MAX_BYTES = 32 * GiB
HOST_TIER_RAM_SHARE = 0.2
"""On a GPU the host tier takes min(32 GiB, 20% of RAM) unless told: ~80k tokens of an 8B model's
KV per 10 GiB, while weights loading, pinned staging and the OS keep the rest. Pinning it takes
time (25 GiB took 17 s on an H100 machine with 128 GiB of RAM): it grows in the background, one
chunk at a time, usable from the first, while the engine is idle or its GPU cache evicts
(ember/kv/tiers/host_memory.py, EngineCore._pace_host_tier)."""
START_PACE: Pace = "idle"
"""The host tier's growth while the engine starts, until its KV cache is sized: four threads, no
rests. Measured on an H200 (8B shape, served_gpu.py): ready 14.1 s against 13.1 s with no tier,
13.9 of 25.2 GiB pinned by the KV sizing and 21.7 GiB when a load starting at ready came; held
until the KV sizing instead ("hold"), 4.1 GiB at the load's start. Growing at the start cost
the start 2.8-5.8 s only while its pages were copied into each forked compile worker, which
MADV_DONTFORK ended (ember/host_pages.py)."""
MIN_DEFAULT_HOST_BYTES = 1 * GiB
"""Less than this left of the process's default host-tier budget: the default tier is off."""
STAGING_BYTES = (64 << 20, 4 * GiB)
STAGING_SEQUENCES = 2
"""With disk or store on and no host share, a small host tier still stages their loads and writes:
two max-length sequences, within 64 MiB to 4 GiB (half of it may wait for the lower tiers before
new writes are dropped)."""


def model_fingerprint(model_dir: str | Path, load_format: str, device: torch.device) -> str:
    """What the model computes, not where it lies: SHA-256 of config.json and the weight files'
    names and sizes. The same model at two paths, or on two nodes, names its KV blocks the same;
    dummy weights are drawn from a fixed seed on the device, so they name the device type."""
    path = Path(model_dir)
    h = hashlib.sha256((path / "config.json").read_bytes())
    if load_format == "dummy":
        h.update(f"\0dummy@{device.type}".encode())
    else:
        for f in safetensors_files(path):
            h.update(f"\0{f.name}\0{f.stat().st_size}".encode())
    return h.hexdigest()[:32]


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_default_claims: dict[int, int] = {}
"""Bytes of the live default-sized host tiers of this process, by id(tier)."""


def host_tier_bytes(config: EngineConfig, device: torch.device) -> int:
    """This rank's host tier size: `kv_host_gb`, else the default for the device (0 on the
    CPU), over the engine's tensor-parallel ranks (each holds its heads of every block: the
    same blocks in 1/N of the bytes each, so the engine holds as many as one device would).

    The default, min(32 GiB, 20% of RAM), is one budget for the whole process, shared by the
    default-sized tiers of its engines: three engines in one process each pinning 20% of RAM
    (a test with three `LLM`s on an H200 machine) were killed for memory."""
    ranks = max(config.tensor_parallel_size, 1)
    if config.kv_host_gb is not None:
        return int(config.kv_host_gb * GiB) // ranks
    if device.type != "cuda":
        return 0
    budget = min(HOST_TIER_MAX_BYTES, int(physical_memory_bytes() * HOST_TIER_RAM_SHARE)) // ranks
    left = budget - sum(_default_claims.values())
    if left < MIN_DEFAULT_HOST_BYTES:
        log.info("KV host tier off: this process's other engines hold its default budget")
        return 0
    return left


def _claim_default(config: EngineConfig, host: HostTier, nbytes: int) -> None:
    """Count a default-sized tier against the process's budget until it is collected."""
    if config.kv_host_gb is None:
        _default_claims[id(host)] = nbytes
        weakref.finalize(host, _default_claims.pop, id(host), None)


def host_tier_blocks(
    config: EngineConfig, device: torch.device, block_bytes: int, max_len: int
) -> int:
    """Blocks of `block_bytes` the host tier holds (0: no host tier): its share of RAM, or at
    least the staging the disk and store tiers need."""
    lower_on = config.kv_disk_dir is not None or config.kv_store is not None
    host_bytes = host_tier_bytes(config, device)
    if not host_bytes and not lower_on or not config.enable_prefix_caching:
        return 0
    num_blocks = host_bytes // block_bytes
    if lower_on:
        sequences = STAGING_SEQUENCES * -(-max_len // config.block_size) * block_bytes
        staging = min(max(sequences, STAGING_BYTES[0]), STAGING_BYTES[1])
        num_blocks = max(num_blocks, staging // block_bytes)
    if num_blocks < 1:
        raise ValueError(
            f"kv_host_gb={config.kv_host_gb} holds no KV block of {block_bytes} bytes; "
            "raise it or set 0 to turn the host tier off"
        )
    return num_blocks


def start_host_memory(
    config: EngineConfig, device: torch.device, block_bytes: int, max_len: int
) -> HostMemory | None:
    """On a GPU, the host tier's pinned memory, started with the engine: it grows (at the
    "idle" pace) while the weights load and the kernels compile, paused while graphs are
    captured, so that the tier is whole by the time requests come. Pinning it after ready, beside
    the first requests, left a server that started under load with 7 of 25 GiB 25 s in (and no
    hits). None on the CPU (its tier is plain memory, allocated at once by `build_tiers`) or
    with no host tier; `build_tiers` takes it, or closes it if it does not fit."""
    if device.type != "cuda":
        return None
    num_blocks = host_tier_blocks(config, device, block_bytes, max_len)
    if not num_blocks:
        return None
    return HostMemory(block_bytes, num_blocks, pin=True, pace=START_PACE)


def lower_tiers(config: EngineConfig, layout: BlockLayout, rank: int) -> list[Tier]:
    """A rank's disk and store tiers, as `config` asks. On a tensor-parallel engine each rank's
    share of the budgets is 1/N, its disk a directory of its own (`rank_disk_dir`), its store
    names its own (the layout's model names the engine's size and the rank: two ranks' blocks of
    the same heads count and bytes would otherwise share names)."""
    ranks = config.tensor_parallel_size
    tiers: list[Tier] = []
    try:
        if config.kv_disk_dir is not None:
            tiers.append(
                DiskTier(
                    rank_disk_dir(config, rank) if ranks > 1 else config.kv_disk_dir,
                    int(config.kv_disk_gb * GiB) // ranks,
                    layout,
                    config.kv_eviction,  # type: ignore[arg-type]  # checked by EngineConfig
                )
            )
        if config.kv_store is not None:
            from ember.kv.tiers.store import StoreTier

            named = layout
            if ranks > 1:
                named = dataclasses.replace(layout, model=f"{layout.model}|tp{ranks}-rank{rank}")
            tiers.append(
                StoreTier(
                    named,
                    config.kv_store,
                    host=config.kv_host,
                    segment_bytes=int(config.kv_store_gb * GiB) // ranks,
                    secret=config.cluster_secret or None,
                )
            )
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def rank_disk_dir(config: EngineConfig, rank: int) -> Path:
    """Where a rank of a tensor-parallel engine keeps its disk tier's blocks: a directory a rank
    under `kv_disk_dir`, named by the engine's size (another size splits the heads otherwise)."""
    assert config.kv_disk_dir is not None
    return Path(config.kv_disk_dir) / f"tp{config.tensor_parallel_size}-rank{rank}"


class WorkerLowerChannel:
    """Rank 0's lower-tier thread's way to the other ranks' disk and store tiers: jobs out with
    the step plans (in order after the copies they follow), answers back on a socket only that
    thread reads."""

    def __init__(self, workers: Workers) -> None:
        self.workers = workers
        self._answers: dict[int, dict[int, int]] = {}
        self._ids = itertools.count(1)

    def new_job_id(self) -> int:
        return next(self._ids)

    def send(
        self, job_id: int, medium: str, write: bool, keys: list[bytes], slots: list[int]
    ) -> None:
        self.workers.send(TierLower(job_id, medium, write, keys, slots))

    def touch(self, medium: str, keys: list[bytes]) -> None:
        self.workers.send(TierTouch(medium, keys))

    def wait(self, job_id: int, timeout_s: float) -> list[int] | None:
        deadline = time.monotonic() + timeout_s
        want = self.workers.size - 1
        while len(self._answers.get(job_id, {})) < want:
            left = deadline - time.monotonic()
            if left <= 0 or self.workers.failure is not None:
                self._answers.pop(job_id, None)
                return None
            if self.workers.tier_acks.poll(min(int(left * 1000) + 1, 100)):
                _, rank, done_id, count = self.workers.tier_acks.recv().decode().split()
                self._answers.setdefault(int(done_id), {})[int(rank)] = int(count)
        return list(self._answers.pop(job_id).values())


def build_lower_replica(
    config: EngineConfig,
    kv_cache: torch.Tensor,
    model: str,
    replica: HostReplica | None,
    rank: int,
    ack: Ack,
) -> LowerReplica | None:
    """A tensor-parallel worker's disk and store tiers, doing rank 0's writes and reads with
    `replica`'s host memory; None with neither."""
    if replica is None or (config.kv_disk_dir is None and config.kv_store is None):
        return None
    layout = BlockLayout.from_kv_cache(kv_cache, model)
    return LowerReplica(replica, lower_tiers(config, layout, rank), ack)


class WorkerReplicas:
    """Rank 0's tier copies and fences, sent to the other ranks after the steps they follow
    (ember/kv/tiers/replica.py)."""

    def __init__(self, workers: Workers) -> None:
        self.workers = workers
        self._pace: str | None = None

    def copy(self, up: bool, slots: list[int], gpu_ids: list[int]) -> None:
        self.workers.send(TierCopy(up, list(slots), list(gpu_ids)))

    def fence(self, block_ids: list[int]) -> None:
        self.workers.send(TierFence(list(block_ids)))

    def pace(self, pace: str) -> None:
        if pace != self._pace:
            self._pace = pace
            self.workers.send(TierPace(pace))


def build_replica(
    config: EngineConfig, kv_cache: torch.Tensor, max_model_len: int, memory: HostMemory | None
) -> HostReplica | None:
    """A tensor-parallel worker's copy of rank 0's host tier over its `kv_cache`, in `memory`
    (started with the engine) when it fits; None when the engine has no host tier."""
    gpu_blocks = block_rows(kv_cache)
    rows = host_tier_blocks(config, kv_cache.device, gpu_blocks.shape[1], max_model_len)
    memory = _fitting(memory, gpu_blocks.shape[1], rows)
    if not rows:
        return None
    if memory is None:
        memory = HostMemory(gpu_blocks.shape[1], rows, pin=kv_cache.is_cuda, pace="hold")
    return HostReplica(memory, gpu_blocks)


def block_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The KV cache (block-major) as uint8 [num_blocks, block bytes]: what the tiers copy."""
    return kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)


def _fitting(memory: HostMemory | None, row_bytes: int, rows: int) -> HostMemory | None:
    """`memory` (started with the engine) if it holds `rows` rows of `row_bytes`; else closed,
    and None (a fresh one is made, or none is needed)."""
    if memory is not None and (memory.row_bytes, memory.target_rows) != (row_bytes, rows):
        memory.close()
        return None
    return memory


def build_tiers(
    config: EngineConfig,
    kv_cache: torch.Tensor,
    model: str,
    max_model_len: int,
    memory: HostMemory | None = None,
    replicas: Replicas | None = None,
    lower_channel: LowerChannel | None = None,
) -> TierManager | None:
    """The TierManager over `kv_cache` (block-major), or None when no tier is on. `model` is the
    model fingerprint that disk entries and store keys carry; `memory` the host tier's, started
    with the engine (`start_host_memory`); `replicas` and `lower_channel` a tensor-parallel
    engine's other ranks (their copies, and their disk and store tiers' jobs)."""
    layout = BlockLayout.from_kv_cache(kv_cache, model)
    num_blocks = host_tier_blocks(config, kv_cache.device, layout.nbytes, max_model_len)
    memory = _fitting(memory, layout.nbytes, num_blocks)
    if not num_blocks:
        asked = config.kv_host_gb or config.kv_disk_dir or config.kv_store
        if asked and not config.enable_prefix_caching:
            log.warning("KV tiers are off: they key blocks by the prefix cache's hashes")
        return None
    lower_on = config.kv_disk_dir is not None or config.kv_store is not None
    host_bytes = host_tier_bytes(config, kv_cache.device)
    # Held until the engine has started (and then paced by it), unless disk or store stage
    # their copies through it from the first request on.
    host = HostTier(
        layout,
        num_blocks,
        pin=kv_cache.is_cuda,
        pace="busy" if lower_on else "hold",
        eviction=config.kv_eviction,  # type: ignore[arg-type]  # checked by EngineConfig
        memory=memory,
    )
    _claim_default(config, host, host_bytes)
    lower: list[Tier] = []
    try:
        lower = lower_tiers(config, layout, 0)
        if lower_channel is not None:
            lower = [ShardedTier(t, lower_channel) for t in lower]
    except BaseException:
        host.close()  # stop its growth: the engine is not starting
        raise
    gpu_blocks = block_rows(kv_cache)
    ranks = config.tensor_parallel_size
    log.info(
        "KV tiers: host %d blocks (%.2f GiB, growing from %.2f GiB%s)%s%s",
        num_blocks,
        num_blocks * layout.nbytes / GiB,
        host.capacity_blocks * layout.nbytes / GiB,
        f"; a rank's, on each of {ranks} ranks" if ranks > 1 else "",
        f", disk {config.kv_disk_dir} ({config.kv_disk_gb:g} GiB)" if config.kv_disk_dir else "",
        f", store {config.kv_store}" if config.kv_store else "",
    )
    return TierManager(
        layout,
        gpu_blocks,
        host,
        lower,
        CostModel(layout),
        record_events=config.kv_events,
        replicas=replicas,
    )


class PrefillClock:
    """Feeds the tiers' cost model this engine's prefill speed from the steps it collects."""

    WARMUP_STEPS = 2
    """Prefill steps not fed to the cost model: the first ones compile kernels (Triton's JIT)
    and would make prefilling look ten times slower than it is."""

    def __init__(self, cost: CostModel, block_size: int, cuda: bool) -> None:
        self.cost = cost
        self.block_size = block_size
        self.cuda = cuda
        self._last_collected = 0.0  # perf_counter() when the host last saw the device's work end
        self._prefill_steps = 0
        # Prompt tokens of collected steps whose device work the host never waited for (a
        # prefill chunk that samples nothing returns at once), and when the first of them began.
        self._unsynced_tokens = 0
        self._unsynced_since = float("inf")

    def observe(self, so: SchedulerOutput, pending: PendingStep) -> None:
        """Feed the tiers' cost model this engine's prefill speed: a step's prompt tokens over its
        time on the device (from its launch, or from the end of the step before it, whichever is
        later). Steps of less than a block of prompt are mostly decode and say little.

        On a GPU, collecting a prefill chunk that samples nothing does not wait for the device (it
        has no tokens to copy back), so its end is unknown: its tokens are counted with the next
        step the host did wait for, over the time since the first of them began. (Timing such a
        chunk alone once measured 11M tokens/s on an H100, and the cost model then never loaded.)"""
        tokens = sum(
            max(0, min(start + n, req.num_prompt_tokens) - start)
            for req, start, n in zip(
                so.requests, so.num_computed_tokens, so.num_scheduled_tokens, strict=True
            )
        )
        now = time.perf_counter()
        began = max(pending.launched_at, self._last_collected)
        if self.cuda and pending.done is None:
            self._unsynced_tokens += tokens
            self._unsynced_since = min(self._unsynced_since, began)
            return
        tokens += self._unsynced_tokens
        began = min(began, self._unsynced_since)
        self._unsynced_tokens, self._unsynced_since = 0, float("inf")
        self._last_collected = now
        if tokens < self.block_size:
            return
        self._prefill_steps += 1
        if self._prefill_steps > self.WARMUP_STEPS:
            self.cost.observe_prefill(tokens, now - began)
