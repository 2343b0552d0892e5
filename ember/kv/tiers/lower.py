"""The lower tiers (disk, then store) behind one background thread, so the engine never waits on
them: fetches for loads go first, then prefetches (a waiting request's blocks read into host ahead
of its admission, bounded), then writes from a bounded backlog (dropped and counted when it is full,
never waited for). A tier that raises is a miss, counted as an error."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ember.kv.tiers.base import Counters, Medium, Tier, leading
from ember.kv.tiers.cost import CostModel
from ember.kv.tiers.host import HostTier
from ember.kv.tiers.prefetch import Found

log = logging.getLogger(__name__)

_FETCH, _PREFETCH, _WRITE, _STOP = 0, 1, 2, 3  # job priorities


@dataclass(slots=True, eq=False)
class Fetch:
    """Read `keys` into host rows `rows` (reserved and pinned by the caller), as a prefix."""

    keys: list[bytes]
    rows: list[int]
    done: threading.Event = field(default_factory=threading.Event)
    num_fetched: int = 0
    """Rows read (a prefix of them); set before `done`."""
    cancelled: bool = False
    read: dict[Medium, int] = field(default_factory=dict)
    """Rows read per tier."""


@dataclass(slots=True, eq=False)
class _Prefetch:
    """A fetch into rows reserved (not pinned) by `LowerTiers.prefetch`, committed by the thread."""

    fetch: Fetch


@dataclass(slots=True, eq=False)
class _Write:
    keys: list[bytes]
    slots: list[int]


class LowerTiers:
    def __init__(
        self,
        tiers: list[Tier],
        host: HostTier,
        cost: CostModel,
        counters: Counters,
        max_pending_writes: int | None,
        max_prefetch_blocks: int | None = None,
    ) -> None:
        """`max_pending_writes`: None for half the host tier's capacity at the time.
        `max_prefetch_blocks`: blocks being prefetched beyond which new prefetches are skipped
        (None: the same limit as the writes')."""
        media = [t.medium for t in tiers]
        if len(set(media)) != len(media) or not set(media) <= {"disk", "store"}:
            raise ValueError(f"lower tiers must be at most one disk and one store, got {media}")
        self.tiers = tiers
        self.host = host
        self.cost = cost
        self.counters = counters
        self.max_pending_writes = max_pending_writes
        self._pending_writes = 0
        self.max_prefetch_blocks = max_prefetch_blocks
        self._prefetching: set[bytes] = set()
        self._lock = threading.Lock()
        self._queue: queue.PriorityQueue[tuple[int, int, object]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        if tiers:
            self._thread = threading.Thread(target=self._work, name="ember-kv-tiers", daemon=True)
            self._thread.start()

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def lookup(self, keys: Sequence[bytes], known: Found | None = None) -> dict[Medium, int]:
        """Blocks found per tier, each going on where the one before stopped (engine thread).
        `known`: what a prefetch found in the tiers whose lookups may wait (the store), which are
        then not asked; without it, they are (and may take up to their lookup timeout)."""
        found: dict[Medium, int] = {"disk": 0, "store": 0}
        pos = 0
        for tier in self.tiers:
            if pos == len(keys):
                break
            if known is not None and tier.lookup_may_wait:
                held = known.get(tier.medium, frozenset())
                n = leading([k in held for k in keys[pos:]])
                found[tier.medium] += n
                pos += n
                continue
            try:
                n = tier.contains_prefix(keys[pos:])
            except Exception:
                log.exception("KV tier %s: lookup failed", tier.medium)
                self.counters.add(tier.medium, errors=1)
                n = 0
            found[tier.medium] += n
            pos += n
        return found

    def write(self, keys: list[bytes], slots: list[int]) -> None:
        """Copy committed host entries down to every tier, in the background; they stay pinned
        until written. Dropped (and counted) when the backlog is full."""
        if not self.tiers:
            return
        with self._lock:
            limit = self.max_pending_writes
            if limit is None:
                limit = self.host.capacity_blocks // 2
            full = self._pending_writes + len(keys) > limit
            if not full:
                self._pending_writes += len(keys)
        if full:
            for tier in self.tiers:
                self.counters.add(tier.medium, drops=len(keys))
            return
        self.host.pin(keys)
        self._submit(_WRITE, _Write(keys, slots))

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Read `keys` (a prefix, found below the host) into host in the background, ahead of a
        request's admission; they are committed there as they arrive and then evicted as any
        entry. Only the leading keys that find a free or evictable slot are read; nothing when the
        prefetches in flight would pass their limit. Returns the blocks queued (any thread)."""
        if not self.tiers or not keys:
            return 0
        with self._lock:
            limit = self.max_prefetch_blocks
            if limit is None:
                limit = self.max_pending_writes
            if limit is None:
                limit = self.host.capacity_blocks // 2
            if len(self._prefetching) + len(keys) > limit:
                return 0
            reserved = self.host.reserve(keys)
            got = leading([s is not None for s in reserved])
            self.host.abort(
                [k for k, s in zip(keys[got:], reserved[got:], strict=True) if s is not None]
            )
            if got == 0:
                return 0
            fetch = Fetch(list(keys[:got]), [s for s in reserved[:got] if s is not None])
            self._prefetching.update(fetch.keys)
        self._submit(_PREFETCH, _Prefetch(fetch))
        return got

    def prefetching(self, keys: Sequence[bytes]) -> bool:
        """Whether any of `keys` is being read into host by a prefetch (a load would find it
        reserved: better to wait for it, as it is read no later than a load's would be)."""
        with self._lock:
            return bool(self._prefetching) and not self._prefetching.isdisjoint(keys)

    def fetch(self, job: Fetch) -> None:
        """Read a load's rows in the background, ahead of any write; `job.done` is set after."""
        self._submit(_FETCH, job)

    def join(self) -> None:
        """Wait until every job queued so far is done."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Stop the thread once the queued jobs are done, then close the tiers."""
        if self._thread is not None:
            self._submit(_STOP, None)
            self._thread.join(timeout=60.0)
            self._thread = None
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                log.exception("KV tier %s: close failed", tier.medium)

    def _submit(self, priority: int, job: object) -> None:
        self._queue.put((priority, next(self._seq), job))

    # -- the background thread ---------------------------------------------------------------

    def _work(self) -> None:
        while True:
            _, _, job = self._queue.get()
            try:
                if isinstance(job, Fetch):
                    self._fetch(job)
                elif isinstance(job, _Prefetch):
                    self._prefetch(job.fetch)
                elif isinstance(job, _Write):
                    self._write(job.keys, job.slots)
                else:
                    return  # stop
            except Exception:
                log.exception("KV tiers: background job failed")
            finally:
                self._queue.task_done()

    def _fetch(self, job: Fetch) -> None:
        nbytes = self.host.layout.nbytes
        keys, rows, pos = job.keys, job.rows, 0
        try:
            for tier in self.tiers:
                if pos == len(keys) or job.cancelled:
                    break
                try:
                    n = tier.contains_prefix(keys[pos:])
                    if n == 0:
                        continue
                    t0 = time.perf_counter()
                    found = tier.get_into_rows(
                        keys[pos : pos + n], self.host.memory, rows[pos : pos + n]
                    )
                    seconds = time.perf_counter() - t0
                except Exception:
                    log.exception("KV tier %s: read failed", tier.medium)
                    self.counters.add(tier.medium, errors=1, misses=len(keys) - pos)
                    continue
                got = leading(found)
                if got:
                    self.cost.observe_load(tier.medium, got * nbytes, seconds)
                pos += got
                job.read[tier.medium] = got
        finally:
            job.num_fetched = pos
            job.done.set()

    def _prefetch(self, job: Fetch) -> None:
        try:
            self._fetch(job)
        finally:
            n = job.num_fetched
            self.host.commit(job.keys[:n])
            self.host.abort(job.keys[n:])
            with self._lock:
                self._prefetching.difference_update(job.keys)
            for medium, got in job.read.items():
                if got:
                    self.counters.add(medium, prefetched=got)

    def _write(self, keys: list[bytes], slots: list[int]) -> None:
        try:
            for tier in self.tiers:
                try:
                    tier.put_rows(keys, self.host.memory, slots)
                except Exception:
                    log.exception("KV tier %s: write failed", tier.medium)
                    self.counters.add(tier.medium, errors=1, drops=len(keys))
        finally:
            self.host.unpin(keys)
            with self._lock:
                self._pending_writes -= len(keys)
