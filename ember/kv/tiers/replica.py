"""The KV tiers of a tensor-parallel engine: rank 0's `TierManager` decides everything (which
key lives in which host slot, what to offload and load, when), and every other rank repeats its
copies on its own heads, between its own cache and its own host memory, in the same slots
(`HostReplica`), and its disk and store writes and reads with its own tiers (`LowerReplica`,
answered to rank 0's `ShardedTier`).

Each rank's block holds its share of the heads, so its host memory has the same number of rows
as rank 0's, each of its own block's bytes. Rank 0 sends each copy after the step plan it follows
(`TierCopy`), so a worker makes it in the same order against its steps:

- an offload (cache -> host) after the step that wrote the blocks, on a side stream that waits
  for the work queued so far;
- a load (host -> cache) after every offload sent before it, on the same side stream: rank 0
  loads only keys whose own copy down has ended, and a worker's copy of those, queued earlier on
  the one stream, has ended too by then; and a slot rank 0 has reused was read by the loads
  queued before the offload that overwrites it;
- `TierFence(block_ids)` before a step that reads blocks just loaded or writes blocks handed
  out again: the worker's device waits for its copies still under way that touch them (rank 0
  cannot tell: its own copies' ends say nothing of a worker's).

On the CPU every copy is made at once (the worker's steps are synchronous). A worker's memory
grows in the background as rank 0's does, at the pace rank 0 sends (`TierPace`); a slot beyond
what it has grown yet is allocated on the spot (`HostMemory.grow_to`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ember.kv.tiers.base import Tier, TierStats, leading
from ember.kv.tiers.host_memory import HostMemory, Pace

log = logging.getLogger(__name__)

LOWER_ACK_TIMEOUT_S = 60.0
"""How long rank 0's lower-tier thread waits for every rank's part of a disk or store write or
read before it counts the keys as not stored, or missed."""


class Replicas(Protocol):
    """Where rank 0's tier sends its copies (ember/engine/kv_tiers.WorkerReplicas)."""

    def copy(self, up: bool, slots: list[int], gpu_ids: list[int]) -> None: ...

    def fence(self, block_ids: list[int]) -> None: ...


class HostReplica:
    """A worker's copy of rank 0's host tier: its memory and its cache's blocks."""

    def __init__(self, memory: HostMemory, gpu_blocks: torch.Tensor) -> None:
        """`gpu_blocks`: this rank's KV cache viewed as uint8 [num_blocks, row_bytes]."""
        if gpu_blocks.dtype != torch.uint8 or gpu_blocks.dim() != 2:
            raise ValueError(
                f"gpu_blocks must be uint8 [num_blocks, nbytes], got {gpu_blocks.dtype}"
            )
        if gpu_blocks.shape[1] != memory.row_bytes:
            raise ValueError(
                f"blocks of {gpu_blocks.shape[1]} bytes, host rows of {memory.row_bytes}"
            )
        self.memory = memory
        self.gpu_blocks = gpu_blocks
        self._cuda = gpu_blocks.is_cuda
        self._stream = torch.cuda.Stream(gpu_blocks.device) if self._cuda else None
        self._pending: list[tuple[torch.cuda.Event, frozenset[int], frozenset[int]]] = []
        """Copies under way on the side stream: their end, the blocks and the slots they touch."""
        self._lock = threading.Lock()  # the step loop's copies against the disk thread's waits
        self.copies = 0
        """Copies made (offloads and loads), for tests and logs."""

    def copy(self, up: bool, slots: list[int], gpu_ids: list[int]) -> None:
        """Rank 0's copy, on this rank's heads: host slots -> cache blocks when `up`, else the
        other way."""
        if len(slots) != len(gpu_ids):
            raise ValueError(f"{len(slots)} slots but {len(gpu_ids)} blocks")
        if not slots:
            return
        n = self.gpu_blocks.shape[0]
        if not all(0 <= b < n for b in gpu_ids) or min(slots) < 0:
            raise ValueError(f"a block outside the cache's {n} or a negative slot")
        self.memory.grow_to(max(slots) + 1)
        move = self.memory.copy_out if up else self.memory.copy_in
        self.copies += 1
        if self._stream is None:
            move(slots, self.gpu_blocks, gpu_ids, False)
            return
        compute = torch.cuda.current_stream(self.gpu_blocks.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(compute)
            move(slots, self.gpu_blocks, gpu_ids, True)
            done = torch.cuda.Event()
            done.record(self._stream)
        with self._lock:
            self._pending = [p for p in self._pending if not p[0].query()]
            self._pending.append((done, frozenset(gpu_ids), frozenset(slots)))

    def fence(self, block_ids: list[int]) -> None:
        """The device's next work waits for the copies under way that touch `block_ids` (the
        host does not wait)."""
        if not self._pending:
            return
        wanted = set(block_ids)
        compute = torch.cuda.current_stream(self.gpu_blocks.device)
        with self._lock:
            for done, touched, _ in self._pending:
                if not wanted.isdisjoint(touched):
                    compute.wait_event(done)

    def wait_slots(self, slots: list[int]) -> None:
        """Wait (this thread) for the copies under way into or out of `slots`: before the disk
        tier reads them, or writes them (rank 0 may reuse a slot whose copy here still runs)."""
        wanted = set(slots)
        with self._lock:
            waits = [done for done, _, touched in self._pending if not wanted.isdisjoint(touched)]
        for done in waits:
            done.synchronize()

    def set_pace(self, pace: Pace) -> None:
        self.memory.pace = pace

    def close(self) -> None:
        """Wait for the copies under way, then let the memory go."""
        with self._lock:
            pending, self._pending = self._pending, []
        for done, _, _ in pending:
            done.synchronize()
        self.memory.close()


class Ack(Protocol):
    """A worker's answer to rank 0 for a lower-tier job, called from its lower-tier thread
    alone."""

    def __call__(self, job_id: int, count: int) -> None: ...

    def close(self) -> None: ...


class LowerReplica:
    """A worker's disk and store tiers, doing rank 0's writes and reads (`TierLower`) with its
    own host memory, in order, on a thread of its own; `ack(job_id, n)` says how many keys, from
    the first, it stored or found."""

    def __init__(self, replica: HostReplica, tiers: Sequence[Tier], ack: Ack) -> None:
        self.replica = replica
        self.tiers: dict[str, Tier] = {t.medium: t for t in tiers}
        self._ack = ack
        self._jobs: queue.Queue[tuple[int, str, bool, list[bytes], list[int]] | None] = (
            queue.Queue()
        )
        self._thread = threading.Thread(target=self._work, name="ember-kv-lower", daemon=True)
        self._thread.start()

    def submit(
        self, job_id: int, medium: str, write: bool, keys: list[bytes], slots: list[int]
    ) -> None:
        self._jobs.put((job_id, medium, write, keys, slots))

    def touch(self, medium: str, keys: list[bytes]) -> None:
        tier = self.tiers.get(medium)
        if tier is not None:
            tier.touch(keys)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job_id, medium, write, keys, slots = job
            n = 0
            try:
                tier = self.tiers[medium]
                if len(keys) != len(slots) or min(slots, default=0) < 0:
                    raise ValueError(f"{len(keys)} keys, {len(slots)} slots")
                self.replica.memory.grow_to(max(slots, default=-1) + 1)
                self.replica.wait_slots(slots)
                if write:
                    n = leading(tier.put_rows(keys, self.replica.memory, slots))
                else:
                    n = leading(tier.get_into_rows(keys, self.replica.memory, slots))
            except Exception:
                log.exception("KV tier %s: this rank's part failed", medium)
            self._ack(job_id, n)
        self._ack.close()  # this thread's socket, closed by this thread

    def close(self) -> None:
        """Finish the jobs queued so far, then close the tiers."""
        self._jobs.put(None)
        self._thread.join(timeout=60.0)
        for tier in self.tiers.values():
            try:
                tier.close()
            except Exception:
                log.exception("KV tier %s: close failed", tier.medium)


class LowerChannel(Protocol):
    """Rank 0's way to the other ranks' lower tiers (ember/engine/kv_tiers.WorkerLowerChannel)."""

    def send(
        self, job_id: int, medium: str, write: bool, keys: list[bytes], slots: list[int]
    ) -> None: ...

    def wait(self, job_id: int, timeout_s: float) -> list[int] | None:
        """Each other rank's count for `job_id`, or None if one did not answer in time."""
        ...

    def touch(self, medium: str, keys: list[bytes]) -> None: ...

    def new_job_id(self) -> int: ...


class ShardedTier(Tier):
    """Rank 0's lower tier on a tensor-parallel engine: rank 0's own tier (its heads of every
    block) decides what is there; each write and read is also made by every other rank on its
    heads, and counts only as far as every rank got (a block one rank lacks is a miss for all)."""

    def __init__(self, local: Tier, channel: LowerChannel) -> None:
        self.local = local
        self.channel = channel
        self.medium = local.medium
        self.lookup_may_wait = local.lookup_may_wait
        self._short = 0
        """Blocks rank 0 read that another rank lacked: misses, not the hits rank 0 counted."""

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        return self.local.contains_prefix(keys)

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        return self.local.present(keys)

    def put(self, keys: Sequence[bytes], src: torch.Tensor) -> list[bool]:
        raise NotImplementedError("a sharded tier moves host slots (put_rows)")

    def get_into(self, keys: Sequence[bytes], dst: torch.Tensor) -> list[bool]:
        raise NotImplementedError("a sharded tier moves host slots (get_into_rows)")

    def put_rows(
        self, keys: Sequence[bytes], memory: HostMemory, slots: Sequence[int]
    ) -> list[bool]:
        return self._both(True, keys, slots, lambda: self.local.put_rows(keys, memory, slots))

    def get_into_rows(
        self, keys: Sequence[bytes], memory: HostMemory, slots: Sequence[int]
    ) -> list[bool]:
        return self._both(False, keys, slots, lambda: self.local.get_into_rows(keys, memory, slots))

    def _both(
        self,
        write: bool,
        keys: Sequence[bytes],
        slots: Sequence[int],
        local: Callable[[], list[bool]],
    ) -> list[bool]:
        """The other ranks' part sent first (it runs beside rank 0's), then rank 0's; the keys
        every rank got, from the first on. A write one rank could not make leaves the others'
        copies unread: a later read counts only what every rank finds."""
        if not keys:
            return []
        job_id = self.channel.new_job_id()
        self.channel.send(job_id, self.medium, write, list(keys), list(slots))
        here = leading(local())
        counts = self.channel.wait(job_id, LOWER_ACK_TIMEOUT_S)
        if counts is None:
            log.warning(
                "KV tier %s: a rank did not answer; its blocks count as missing", self.medium
            )
            got = 0
        else:
            got = min([here, *counts])
        if not write:
            self._short += here - got
        return [i < got for i in range(len(keys))]

    def touch(self, keys: Sequence[bytes]) -> None:
        self.local.touch(keys)
        self.channel.touch(self.medium, list(keys))

    def stats(self) -> TierStats:
        """Rank 0's tier's counters, its hits only those every rank had."""
        stats = self.local.stats()
        stats.hits -= self._short
        stats.misses += self._short
        return stats

    def close(self) -> None:
        self.local.close()
