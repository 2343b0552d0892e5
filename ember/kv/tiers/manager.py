"""The engine's one door to the KV tiers: it copies computed blocks down (GPU -> host -> disk and
store, write-through) and loads hits back up into GPU blocks, without ever blocking the step loop.

The engine thread calls, in this order of a request's life (no call waits on I/O or the GPU):

- `prefetch(request_id, keys)` when a request arrives, with its prompt's full blocks: the store is
  asked in the background, never at scheduling, and the disk and store blocks worth loading are
  read into host right away (bounded), so that a request that queues finds them there;
- `lookup(keys, request_id)` at scheduling, for the prompt's full blocks past its GPU prefix hit
  (None while the store's answer is still out, for a short grace, or while its blocks are being
  prefetched into host: ask again next step), then
  `plan(hit)` (or `should_load(hit)`) to decide whether loading beats recomputing, and
  `count_decision(hit, chosen)` and `forget(request_id)` once the request is admitted (or
  `forget` when it ends waiting);
- `start_load(load_id, keys, gpu_block_ids)` with freshly allocated GPU blocks for the keys to load,
  then `poll_loads()` every step until it reports `(load_id, blocks_loaded)`: only then may the
  blocks be read (and published); blocks past `blocks_loaded` are recomputed. `cancel(load_id)` if
  the request ends first; its GPU blocks may then be freed at once;
- `offload(pairs, after)` for the full blocks a step computes, right after launching that step
  (`after`: a CUDA event recorded after it; None when the step is done already or on CPU), and
  `step_done()` after every step's results are collected: it commits finished copies to the host
  (on CPU it makes them: this is when the step's blocks are known to be written) and queues them
  for disk and store;
- `fence(block_ids)` before launching a step that writes blocks which may still be being copied
  out (blocks reused from the GPU's free queue): the GPU, not the host, waits for those copies;
- `flush()` to wait for every copy and write (tests, shutdown), `close()` at the end.

Disk and store run in one background thread: loads first, then writes from a bounded backlog
(writes beyond it are dropped and counted, never waited for). A tier that raises is a miss.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import overload

import torch

from ember.kv.tiers.base import (
    BlockLayout,
    Counters,
    Medium,
    Tier,
    TierEvent,
    TierHit,
    TierStats,
    leading,
)
from ember.kv.tiers.cost import CostModel
from ember.kv.tiers.host import HostTier
from ember.kv.tiers.lower import Fetch, LowerTiers
from ember.kv.tiers.prefetch import GRACE_S, Found, LookupPrefetch
from ember.kv.tiers.replica import Replicas

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Offload:
    """GPU -> host copies of one `offload` call, committed to the host tier once done."""

    keys: list[bytes]
    slots: list[int]
    gpu_ids: list[int]
    done: torch.cuda.Event | None  # the copy's end on CUDA; None on CPU
    copied: bool = False  # on CPU: made by `fence` before `step_done`


@dataclass(slots=True, eq=False)
class _Load:
    load_id: str
    keys: list[bytes]
    gpu_ids: list[int]
    slots: list[int]
    """Host slot of keys[i], for i < len(slots): pinned entries, then reserved ones to fetch."""
    num_host: int
    fetch: Fetch | None  # None: everything to load is in host already
    cancelled: bool = False
    num_ok: int = 0
    copy: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # host -> GPU start, end (CUDA)
    copy_started: float = 0.0
    copying: bool = False

    @property
    def fetched(self) -> bool:
        return self.fetch is None or self.fetch.done.is_set()


class TierManager:
    """Owns the host tier and the lower tiers; the engine's only door to them."""

    def __init__(
        self,
        layout: BlockLayout,
        gpu_blocks: torch.Tensor,
        host: HostTier,
        lower: list[Tier],
        cost: CostModel,
        max_pending_writes: int | None = None,
        record_events: bool = False,
        lookup_grace_s: float = GRACE_S,
        max_prefetch_blocks: int | None = None,
        replicas: Replicas | None = None,
    ) -> None:
        """`gpu_blocks`: the KV cache viewed as uint8 [num_blocks, nbytes]. `lower`: disk and / or
        store, searched in that order. `max_pending_writes`: blocks waiting for the lower tiers
        beyond which new writes are dropped (default: half the host tier's capacity at the time,
        as it grows, since they stay pinned). `record_events`: keep the tiers' KV events for
        `drain_events` (host and disk, and the store's "stored" events for what this engine wrote).
        `lookup_grace_s`: how long a request's admission may wait for its store lookup.
        `max_prefetch_blocks`: blocks read ahead of admission at once, beyond which prefetches
        are skipped (default: the write backlog's limit). `replicas`: a tensor-parallel
        engine's other ranks, which repeat every copy between cache and host on their own heads
        (ember/kv/tiers/replica.py)."""
        if gpu_blocks.dtype != torch.uint8 or gpu_blocks.dim() != 2:
            raise ValueError(
                f"gpu_blocks must be uint8 [num_blocks, nbytes], got {gpu_blocks.dtype}"
            )
        if gpu_blocks.shape[1] != layout.nbytes or host.layout != layout:
            raise ValueError(
                f"layouts differ: GPU blocks of {gpu_blocks.shape[1]} bytes, host blocks of "
                f"{host.layout.nbytes}, layout of {layout.nbytes}"
            )
        self.layout = layout
        self.gpu_blocks = gpu_blocks
        self.replicas = replicas
        self.host = host
        self.cost = cost
        self.counters = Counters(["cpu", *(t.medium for t in lower)])
        self.lower = LowerTiers(
            lower, host, cost, self.counters, max_pending_writes, max_prefetch_blocks
        )
        self.prefetches = LookupPrefetch(
            lower, self.counters, lookup_grace_s, on_found=self._prefetch_blocks
        )
        self._cuda = gpu_blocks.is_cuda
        self._d2h = torch.cuda.Stream(gpu_blocks.device) if self._cuda else None
        self._h2d = torch.cuda.Stream(gpu_blocks.device) if self._cuda else None
        self._offloads: deque[_Offload] = deque()
        self._loads: dict[str, _Load] = {}
        self._draining: list[_Load] = []  # cancelled loads whose copies have not ended yet
        self._closed = False
        self._event_logs = [
            log for t in [host, *lower] if (log := getattr(t, "events", None)) is not None
        ]
        for event_log in self._event_logs:
            event_log.enabled = record_events

    # -- read path ---------------------------------------------------------------------------

    def prefetch(self, request_id: str, keys: Sequence[bytes]) -> None:
        """Start looking `keys` (a request's prompt blocks) up in the store in the background, so
        that `lookup(..., request_id)` finds the answer, then reading the disk and store blocks
        the cost model would load into host. Without a store, disk (an index in memory) is
        looked up here and its blocks are read at once."""
        if self.prefetches:
            self.prefetches.start(request_id, keys)
        elif self.lower:
            self._prefetch_blocks(list(keys), {})

    def _prefetch_blocks(self, keys: list[bytes], found: Found) -> None:
        """Read the disk and store blocks of `keys` that `plan` would load into host, in the
        background (any thread: the engine's, or the lookup thread with the store's answer)."""
        host = self.host.contains_prefix(keys)
        below = self.lower.lookup(keys[host:], found)
        chosen = self.plan(TierHit(host=host, disk=below["disk"], store=below["store"]))
        if chosen.disk or chosen.store:
            self.lower.prefetch(keys[host : host + chosen.disk + chosen.store])

    @overload
    def lookup(self, keys: Sequence[bytes], request_id: None = None) -> TierHit: ...
    @overload
    def lookup(self, keys: Sequence[bytes], request_id: str) -> TierHit | None: ...
    def lookup(self, keys: Sequence[bytes], request_id: str | None = None) -> TierHit | None:
        """The longest prefix of `keys` found in host, then disk, then store.

        With `request_id` (scheduling), the store is never asked here: its answer comes from the
        request's prefetch (started now if it has none). While that is out and younger than the
        grace, the result is None (unless host and disk hold every key): ask again next step;
        past the grace, the store is a miss for this request. It is None too while blocks of the
        hit are being prefetched into host (a load now would find them reserved; the prefetch
        ends no later than that load would). Without `request_id`, the store is asked here and
        may take up to its lookup timeout (tests, tools).
        """
        known: Found | None = None
        pending = False
        if request_id is not None:
            self.prefetches.start(request_id, keys)
            known = self.prefetches.result(request_id)  # an answer's prefetch is queued before it
            pending = known is None
            # Asked before host is counted: a prefetch commits its blocks to host before it
            # stops being in flight, so one that lands after this question is counted in host
            # below. Asked after (as it was), a prefetch landing between the two was seen in
            # neither and its blocks were loaded again from the store.
            if self.lower.prefetching(keys):
                return None  # being read into host: a load now would find the blocks reserved
        host = self.host.contains_prefix(keys)
        below = self.lower.lookup(keys[host:], {} if pending else known)
        hit = TierHit(host=host, disk=below["disk"], store=below["store"])
        if pending and hit.num_blocks < len(keys):
            return None
        return hit

    def forget(self, request_id: str) -> None:
        """Drop the request's prefetched lookup: it was admitted, or ended."""
        self.prefetches.forget(request_id)

    def should_load(self, hit: TierHit, prefill_tok_s: float | None = None) -> bool:
        """Whether loading the whole hit beats recomputing it (`prefill_tok_s`: the engine's
        speed, or None for the cost model's measured one)."""
        return self.cost.should_load(hit, prefill_tok_s)

    def plan(self, hit: TierHit, prefill_tok_s: float | None = None) -> TierHit:
        """The prefix of the hit worth loading (maybe empty). Not counted: a waiting request is
        planned again each step; `count_decision` counts the one it is admitted with."""
        return self.cost.plan(hit, prefill_tok_s)

    def count_lookup(self, asked: int, hit: TierHit) -> None:
        """Count an admitted request's lookup of `asked` blocks past its GPU hit: each tier's
        misses are the blocks asked of it (those the tiers above did not hold) that it did not
        hold either. Hits are counted where blocks are read (`start_load`, the lower tiers)."""
        left = asked - hit.host
        self.counters.add("cpu", misses=left)
        for tier in self.lower.tiers:
            found = hit.by_medium()[tier.medium]
            left -= found
            if self.counters.has(tier.medium):
                self.counters.add(tier.medium, misses=left)

    def touch(self, keys: Sequence[bytes]) -> None:
        """A request that ended used these blocks (its prompt's and output's, in order): what
        the eviction policy learns each block's reuse from, whichever tier holds it."""
        if keys:
            self.host.touch(keys)
            for tier in self.lower.tiers:
                tier.touch(keys)

    def count_decision(self, hit: TierHit, chosen: TierHit) -> None:
        """Count, per tier of the hit, one decision to load (`chosen` takes blocks of that tier)
        or to recompute."""
        load = chosen.by_medium()
        for medium, n in hit.by_medium().items():
            if n and self.counters.has(medium):
                self.counters.add(medium, **({"loads": 1} if load[medium] else {"recomputes": 1}))

    def start_load(self, load_id: str, keys: Sequence[bytes], gpu_block_ids: list[int]) -> None:
        """Load `keys` into `gpu_block_ids` (one each): host entries are pinned, the rest fetched
        from disk / store into host slots in the background; `poll_loads` reports the end."""
        if len(keys) != len(gpu_block_ids):
            raise ValueError(f"{len(keys)} keys but {len(gpu_block_ids)} GPU blocks")
        if load_id in self._loads:
            raise ValueError(f"load {load_id!r} is already running")
        self._check_gpu_ids(gpu_block_ids)
        keys = list(keys)
        slots: list[int] = []
        for key in keys:
            slot = self.host.lookup(key)
            if slot is None:
                break
            slots.append(slot)
        num_host = len(slots)
        self.host.pin(keys[:num_host])
        self.host.count_reads(num_host)
        if self.lower and num_host < len(keys):
            rest = keys[num_host:]
            reserved = self.host.reserve(rest)
            got = leading([s is not None for s in reserved])
            # A load is a prefix: what follows a key with no room is not fetched.
            self.host.abort(
                [k for k, s in zip(rest[got:], reserved[got:], strict=True) if s is not None]
            )
            slots.extend(s for s in reserved[:got] if s is not None)
        fetch = None
        if len(slots) > num_host:
            self.host.pin(keys[num_host : len(slots)])
            fetch = Fetch(keys[num_host : len(slots)], slots[num_host:])
            self.lower.fetch(fetch)
        self._loads[load_id] = _Load(load_id, keys, list(gpu_block_ids), slots, num_host, fetch)

    def poll_loads(self) -> list[tuple[str, int]]:
        """Loads that ended since the last call: (load_id, blocks now in their GPU blocks)."""
        self._reap_draining()
        out: list[tuple[str, int]] = []
        for load in list(self._loads.values()):
            if not load.copying:
                if not load.fetched:
                    continue
                self._end_fetch(load)
                self._copy_up(load)
            if load.copy is not None and not load.copy[1].query():
                continue
            self._end_copy(load)
            del self._loads[load.load_id]
            if self.replicas is not None and load.num_ok:
                # The steps that read these blocks come next: the other ranks' too.
                self.replicas.fence(load.gpu_ids[: load.num_ok])
            out.append((load.load_id, load.num_ok))
        return out

    def cancel(self, load_id: str) -> None:
        """Drop a load (its request ended): the GPU waits for a copy into its blocks already under
        way, so the engine may free them at once; the host is cleaned up when the copies end."""
        load = self._loads.pop(load_id, None)
        if load is None:
            return
        load.cancelled = True
        if load.fetch is not None:
            load.fetch.cancelled = True
        if load.copy is not None:
            torch.cuda.current_stream(self.gpu_blocks.device).wait_event(load.copy[1])
        if self.replicas is not None and load.copying and load.num_ok:
            self.replicas.fence(load.gpu_ids[: load.num_ok])
        self._draining.append(load)
        self._reap_draining()

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    # -- write path --------------------------------------------------------------------------

    def offload(
        self, pairs: Iterable[tuple[int, bytes]], after: torch.cuda.Event | None = None
    ) -> None:
        """Copy GPU blocks (id, key) to the host once the work before `after` (or, when None, all
        work queued so far) has written them; keys already in host are skipped, keys with no room
        left are dropped. Then on to disk and store. Never blocks."""
        keys: list[bytes] = []
        ids: list[int] = []
        seen: set[bytes] = set()
        for gpu_id, key in pairs:
            if key in seen or self.host.holds(key):
                continue
            seen.add(key)
            keys.append(key)
            ids.append(gpu_id)
        if not keys:
            return
        self._check_gpu_ids(ids)
        reserved = self.host.reserve(keys)
        kept = [i for i, s in enumerate(reserved) if s is not None]
        if len(kept) < len(keys):
            self.counters.add("cpu", drops=len(keys) - len(kept))
        if not kept:
            return
        slots = [s for s in reserved if s is not None]
        job = _Offload([keys[i] for i in kept], slots, [ids[i] for i in kept], None)
        if self._cuda:
            compute = torch.cuda.current_stream(self.gpu_blocks.device)
            with torch.cuda.stream(self._d2h):
                if after is not None:
                    self._d2h.wait_event(after)
                else:
                    self._d2h.wait_stream(compute)
                self.host.memory.copy_in(job.slots, self.gpu_blocks, job.gpu_ids, True)
                job.done = torch.cuda.Event()
                job.done.record(self._d2h)
        self._offloads.append(job)
        if self.replicas is not None:
            self.replicas.copy(False, job.slots, job.gpu_ids)

    def step_done(self) -> None:
        """Commit finished GPU -> host copies (on CPU: make them now) and queue them for the lower
        tiers; tidy cancelled loads. Call after each step's results are collected."""
        while self._offloads:
            job = self._offloads[0]
            if job.done is None:
                self._copy_down(job)
            elif not job.done.query():
                break  # one stream: later copies end later
            self._offloads.popleft()
            self.host.commit(job.keys)
            self.lower.write(job.keys, job.slots)
        self._reap_draining()

    def fence(self, block_ids: Iterable[int] | None = None) -> None:
        """Make the GPU's current stream wait for copies still reading `block_ids` (all if None)
        before it runs what comes next; the host does not wait (on CPU, the copies are made now)."""
        if self.replicas is not None:
            ids = list(range(self.gpu_blocks.shape[0]) if block_ids is None else block_ids)
            block_ids = ids
            if ids:
                self.replicas.fence(ids)  # theirs may still run when ours have ended
        if self._offloads:
            stream = torch.cuda.current_stream(self.gpu_blocks.device) if self._cuda else None
            self._wait_offloads(block_ids, stream)

    def _wait_offloads(
        self, block_ids: Iterable[int] | None, stream: torch.cuda.Stream | None
    ) -> None:
        """Order `stream` after the pending copies out of `block_ids` (on CPU: make them now)."""
        wanted = None if block_ids is None else set(block_ids)
        for job in self._offloads:
            if wanted is not None and wanted.isdisjoint(job.gpu_ids):
                continue
            if job.done is None:
                self._copy_down(job)
            elif stream is not None:
                stream.wait_event(job.done)

    @property
    def pending_offloads(self) -> int:
        return sum(len(job.keys) for job in self._offloads)

    # -- life --------------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every GPU -> host copy and every disk / store write and fetch queued so far."""
        for job in self._offloads:
            if job.done is not None:
                job.done.synchronize()
        self.step_done()
        self.lower.join()

    def drain_events(self) -> list[TierEvent]:
        """KV events since the last call, host's, disk's then the store's: ("stored" | "removed",
        key, "cpu" | "disk" | "store"; the store's are "stored" only); none unless
        `record_events`."""
        return [e for event_log in self._event_logs for e in event_log.drain()]

    def stats(self) -> dict[Medium, TierStats]:
        """Each tier's counters, with the manager's (drops, errors, decisions) added in."""
        out: dict[Medium, TierStats] = {"cpu": self.counters.merged("cpu", self.host.stats())}
        for tier in self.lower.tiers:
            out[tier.medium] = self.counters.merged(tier.medium, tier.stats())
        return out

    def close(self, wait: bool = True) -> None:
        """Stop the background thread (after the queued writes when `wait`) and close the tiers."""
        if self._closed:
            return
        self._closed = True
        if wait:
            self.flush()
        self.prefetches.close()
        self.lower.close()
        self.host.close()

    def growth_paused(self) -> contextlib.AbstractContextManager[None]:
        """A block in which the host tier allocates no memory (around CUDA graph capture)."""
        return self.host.memory.paused()

    # -- engine-thread helpers ---------------------------------------------------------------

    def _check_gpu_ids(self, ids: Sequence[int]) -> None:
        n = self.gpu_blocks.shape[0]
        for b in ids:
            if not 0 <= b < n:
                raise ValueError(f"GPU block id {b} is outside the cache's {n} blocks")

    def _copy_down(self, job: _Offload) -> None:
        """GPU -> host on CPU, once."""
        if not job.copied:
            self.host.memory.copy_in(job.slots, self.gpu_blocks, job.gpu_ids, False)
            job.copied = True

    def _end_fetch(self, load: _Load) -> None:
        """Publish the fetched rows in the host tier (still pinned) and give back the others."""
        fetched = 0
        if load.fetch is not None:
            fetched = load.fetch.num_fetched
            self.host.commit(load.fetch.keys[:fetched])
            self.host.abort(load.fetch.keys[fetched:])
        load.num_ok = load.num_host + fetched
        del load.slots[load.num_ok :]

    def _copy_up(self, load: _Load) -> None:
        """Host -> GPU: on CUDA on a side stream after the work queued so far (its blocks may
        have been in use until then); on CPU at once."""
        load.copying = True
        load.copy_started = time.perf_counter()
        if load.num_ok == 0:
            return
        gpu_ids = load.gpu_ids[: load.num_ok]
        if self.replicas is not None:
            self.replicas.copy(True, load.slots, gpu_ids)
        # A freed block may still be being copied out (offloaded just before its request ended).
        if not self._cuda:
            self._wait_offloads(gpu_ids, None)
            self.host.memory.copy_out(load.slots, self.gpu_blocks, gpu_ids, False)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        compute = torch.cuda.current_stream(self.gpu_blocks.device)
        with torch.cuda.stream(self._h2d):
            self._h2d.wait_stream(compute)
            self._wait_offloads(gpu_ids, self._h2d)
            start.record(self._h2d)
            self.host.memory.copy_out(load.slots, self.gpu_blocks, gpu_ids, True)
            end.record(self._h2d)
        load.copy = (start, end)

    def _end_copy(self, load: _Load) -> None:
        self.host.unpin(load.keys[: load.num_ok])
        if load.num_ok == 0 or load.cancelled:
            return
        if load.copy is not None:
            seconds = load.copy[0].elapsed_time(load.copy[1]) / 1e3
        else:
            seconds = time.perf_counter() - load.copy_started
        self.cost.observe_load("cpu", load.num_ok * self.layout.nbytes, seconds)

    def _reap_draining(self) -> None:
        """Free the host side of cancelled loads whose fetch and copy have ended."""
        still = []
        for load in self._draining:
            if not load.copying:
                if not load.fetched:
                    still.append(load)
                    continue
                self._end_fetch(load)
                load.copying = True  # nothing will be copied
            elif load.copy is not None and not load.copy[1].query():
                still.append(load)
                continue
            self.host.unpin(load.keys[: load.num_ok])
        self._draining = still
