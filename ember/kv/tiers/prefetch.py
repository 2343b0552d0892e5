"""Store lookups ahead of admission: a request's prompt blocks are looked up in the tiers whose
lookups may wait on a network (the store) in a background thread as soon as it arrives, so that
scheduling reads the answer instead of asking the store (up to a second on a slow master) while
every running request waits for its next step. An `on_found` callback hears each answer (in that
thread): the tier manager then starts reading the blocks into host.

Only the engine thread calls `start`, `result` and `forget`; the lookups run in one thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ember.kv.tiers.base import Counters, Medium, Tier

log = logging.getLogger(__name__)

GRACE_S = 0.05
"""How long a request's admission may wait (steps of the others go on) for its store lookup: a
healthy master answers in about a millisecond, while an idle engine schedules a request within
microseconds of its arrival. Past it, the request is admitted as a store miss."""
MAX_LOOKUPS = 1024
"""Requests whose answers are kept (waiting requests); past it, new arrivals get none until
admission starts theirs."""

Found = Mapping[Medium, frozenset[bytes]]
"""The keys each slow tier holds, of those looked up."""
OnFound = Callable[[list[bytes], Found], None]
"""Called in the lookup thread with a request's keys and their answer."""


@dataclass(slots=True, eq=False)
class _Lookup:
    future: Future[Found]
    started: float  # time.monotonic()


class LookupPrefetch:
    """Background lookups in the slow tiers, kept per request id until it is admitted or ends."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        counters: Counters,
        grace_s: float = GRACE_S,
        max_lookups: int = MAX_LOOKUPS,
        on_found: OnFound | None = None,
    ) -> None:
        if grace_s < 0 or max_lookups < 1:
            raise ValueError(f"bad grace_s={grace_s} or max_lookups={max_lookups}")
        self.tiers = [t for t in tiers if t.lookup_may_wait]
        self.counters = counters
        self.grace_s = grace_s
        self.max_lookups = max_lookups
        self.on_found = on_found
        self._lookups: dict[str, _Lookup] = {}
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-kv-lookup")
            if self.tiers
            else None
        )

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def __len__(self) -> int:
        return len(self._lookups)

    def start(self, request_id: str, keys: Sequence[bytes]) -> None:
        """Look `keys` up in the background, unless this request's lookup is out already or the
        table is full (its admission then finds no answer and starts one)."""
        if self._pool is None or not keys or request_id in self._lookups:
            return
        if len(self._lookups) >= self.max_lookups:
            return
        future = self._pool.submit(self._look_up, list(keys))
        self._lookups[request_id] = _Lookup(future, time.monotonic())

    def result(self, request_id: str) -> Found | None:
        """The request's answer; None while it is out and younger than the grace. A lookup that
        failed, overran the grace or was never started is a miss (an empty answer)."""
        lookup = self._lookups.get(request_id)
        if lookup is None:
            return {}
        if lookup.future.done():
            return lookup.future.result()  # _look_up never raises
        if time.monotonic() - lookup.started < self.grace_s:
            return None
        return {}

    def forget(self, request_id: str) -> None:
        """Drop the request's answer (admitted or ended); a lookup not begun yet never runs."""
        lookup = self._lookups.pop(request_id, None)
        if lookup is not None:
            lookup.future.cancel()

    def close(self) -> None:
        for request_id in list(self._lookups):
            self.forget(request_id)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _look_up(self, keys: list[bytes]) -> Found:
        found: dict[Medium, frozenset[bytes]] = {}
        for tier in self.tiers:
            try:
                present = tier.present(keys)
            except Exception:
                log.exception("KV tier %s: lookup failed", tier.medium)
                self.counters.add(tier.medium, errors=1)
                present = []
            found[tier.medium] = frozenset(k for k, ok in zip(keys, present, strict=False) if ok)
        if self.on_found is not None:
            try:
                self.on_found(keys, found)
            except Exception:
                log.exception("KV tiers: handling a lookup's answer failed")
        return found
