"""Which cached KV block goes first when room is needed: the GPU prefix cache and each tier ask this.

Agents come back. Every turn of a session resends its whole prefix, after the other sessions'
turns, so the blocks are reused in rounds. LRU evicts the block used longest ago, which under a
round-robin over more sessions than the cache holds is always the one needed next: it keeps no
hits at all. Belady's rule, evict the block needed farthest in the future, keeps a fixed share of
the sessions and hits on them every round; `NextUse` approximates it from each block's own past:

- A block's reuse interval is learned from its uses (a running mean of the intervals between
  them, uses closer than `SAME_USE_S` being one), and its next use is predicted one interval
  after its last. A request that ends is a use of each of its blocks.
- The block whose predicted next use is farthest from now goes first, either way: a block long
  past its time is likely dead (its session ended), one just used by a round-robin session is
  needed last.
- A block used once has no interval yet: it is given the cache's typical one (the median of the
  known ones; while none is known, twice the median time since the blocks' last use, which is
  a round-robin's period), so a new session stands like the others, and a one-off prompt that
  never comes back ages out of its time.
- A session's blocks are used together and so share their times; among blocks predicted alike
  (within `QUANTUM_SHARE` of the typical interval), the deepest in its prompt goes first, so that
  what stays is whole prefixes from their start, the only part a later request can hit; then
  the one used longest ago.
- The history of evicted blocks is kept (a bounded number) for when they come back.

`LRU` has the same interface (the oldest use first, deepest first among equals): to measure the
one against the other, and for loads with no reuse pattern.

Both work on slots (a GPU block id, a host tier's row): numpy arrays indexed by slot, so that
choosing victims among thousands of blocks is a vector operation, not a Python loop. They are not
thread-safe: their owner's lock covers them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import Literal

import numpy as np

Policy = Literal["next-use", "lru"]
POLICIES: tuple[Policy, ...] = ("next-use", "lru")

SAME_USE_S = 0.5
"""Uses of a block closer than this count as one (requests of one turn ending together: an
agent's parallel tool calls, a shared system prompt); its interval is learned from uses further
apart."""
DEFAULT_INTERVAL_S = 30.0
"""The typical interval of an empty cache."""
QUANTUM_SHARE = 0.05
"""Predictions closer than this share of the typical interval count as equal (then deepest first)."""
REFRESH_SHARE = 0.02
"""A computed eviction order is reused for this share of the typical interval (at most 1 s)."""


class EvictionPolicy:
    """Per-slot times and depths, and the order in which resident slots should be evicted."""

    def __init__(
        self,
        num_slots: int = 0,
        clock: Callable[[], float] = time.monotonic,
        history: int | None = None,
    ) -> None:
        """`history`: how many non-resident keys keep their times (default 4x the slots, at
        least 4,096)."""
        self.clock = clock
        self._history_cap = history
        self._last = np.zeros(0)
        self._interval = np.zeros(0)
        self._depth = np.zeros(0, dtype=np.int64)
        self._resident = np.zeros(0, dtype=bool)
        self._gen = np.zeros(0, dtype=np.int64)  # bumped by every change of a slot's times
        # Placed with no use known (a block written down before its request ended): its first
        # use sets its time but teaches no interval.
        self._fresh = np.zeros(0, dtype=bool)
        self._typical = DEFAULT_INTERVAL_S  # as of the last computed order
        self._key_of: dict[int, bytes] = {}
        self._slot_of: dict[bytes, int] = {}
        self._ghosts: OrderedDict[bytes, tuple[float, float, int]] = OrderedDict()
        self._queue: list[tuple[int, int]] = []
        self._queue_at = -float("inf")
        self.resize(num_slots)

    @property
    def history_cap(self) -> int:
        return self._history_cap if self._history_cap is not None else max(4096, 4 * self.num_slots)

    @property
    def num_slots(self) -> int:
        return len(self._resident)

    def resize(self, num_slots: int) -> None:
        """Grow to `num_slots` slots (a host tier's memory grows; it never shrinks)."""
        n = num_slots - self.num_slots
        if n < 0:
            raise ValueError(f"cannot shrink from {self.num_slots} to {num_slots} slots")
        self._last = np.concatenate([self._last, np.zeros(n)])
        self._interval = np.concatenate([self._interval, np.full(n, np.nan)])
        self._depth = np.concatenate([self._depth, np.zeros(n, dtype=np.int64)])
        self._resident = np.concatenate([self._resident, np.zeros(n, dtype=bool)])
        self._gen = np.concatenate([self._gen, np.zeros(n, dtype=np.int64)])
        self._fresh = np.concatenate([self._fresh, np.zeros(n, dtype=bool)])

    def holds(self, slot: int) -> bool:
        """Whether `slot` holds a block (placed and not cleared)."""
        return bool(self._resident[slot])

    def key_of(self, slot: int) -> bytes:
        """The key a resident slot holds."""
        return self._key_of[slot]

    def touch(self, keys: Sequence[bytes]) -> None:
        """A request uses these blocks now, `keys` being its prompt's blocks in order (their
        position is their depth); keys not resident keep the use in their history."""
        now = self.clock()
        for depth, key in enumerate(keys):
            slot = self._slot_of.get(key)
            if slot is not None:
                if self._fresh[slot]:
                    self._last[slot], self._fresh[slot] = now, False
                else:
                    last, interval = self._last[slot], self._interval[slot]
                    self._last[slot], self._interval[slot] = self._used(last, interval, now)
                self._depth[slot] = depth
                self._gen[slot] += 1
                continue
            ghost = self._ghosts.pop(key, None)
            if ghost is None:
                self._ghosts[key] = (now, np.nan, depth)
            else:
                self._ghosts[key] = (*self._used(ghost[0], ghost[1], now), depth)
            self._trim_history()

    def place(
        self, slot: int, key: bytes, depth: int | None = None, last: float | None = None
    ) -> None:
        """`key` is now held in `slot`: its history (if any) comes with it, else it counts as used
        `last` (default now); `depth` (its block's position in a prompt) when known, else its
        history's or 0."""
        if self._resident[slot]:
            raise ValueError(f"slot {slot} already holds a block")
        ghost = self._ghosts.pop(key, None)
        if ghost is None:
            last, interval, known_depth = self.clock() if last is None else last, np.nan, 0
        else:
            last, interval, known_depth = ghost
        self._fresh[slot] = ghost is None
        self._last[slot] = last
        self._interval[slot] = interval
        self._depth[slot] = known_depth if depth is None else depth
        self._resident[slot] = True
        self._gen[slot] += 1
        self._key_of[slot] = key
        self._slot_of[key] = slot

    def clear(self, slot: int) -> None:
        """`slot` no longer holds its block (evicted or taken out); its key keeps its history."""
        if not self._resident[slot]:
            return
        self._resident[slot] = False
        self._gen[slot] += 1
        key = self._key_of.pop(slot)
        del self._slot_of[key]
        self._ghosts[key] = (
            float(self._last[slot]),
            float(self._interval[slot]),
            int(self._depth[slot]),
        )
        self._trim_history()

    def victims(self, n: int, exclude: Collection[int] = ()) -> list[int]:
        """Up to `n` resident slots, not in `exclude`, in the order they should be evicted. The
        slots are not cleared: the caller evicts them and calls `clear`."""
        out: list[int] = []
        if n <= 0:
            return out
        now = self.clock()
        fresh = now - self._queue_at <= min(1.0, REFRESH_SHARE * self._typical)
        for attempt in range(2):
            if attempt or not fresh or not self._queue:
                self._queue = self._order(max(n, 32, self.num_slots // 64), now)
                self._queue_at = now
            while self._queue and len(out) < n:
                slot, gen = self._queue.pop()
                # Skipped: slots used, refilled or emptied since the order was computed.
                if gen == self._gen[slot] and slot not in exclude and slot not in out:
                    out.append(slot)
            if len(out) == n or attempt:
                break
        return out

    def typical_interval(self, now: float | None = None) -> float:
        """The median of the resident blocks' known intervals; if none is known, twice the
        median time since their last use (`DEFAULT_INTERVAL_S` for an empty cache)."""
        interval = self._interval[self._resident]
        known = interval[~np.isnan(interval)]
        if len(known):
            return float(np.median(known))
        if not len(interval):
            return DEFAULT_INTERVAL_S
        now = self.clock() if now is None else now
        return max(2.0 * float(np.median(now - self._last[self._resident])), 1e-3)

    def _scores(self, slots: np.ndarray, now: float) -> np.ndarray:
        """Larger is evicted first; equal ones deepest first, then oldest first."""
        interval = self._interval[slots]
        interval = np.where(np.isnan(interval), self._typical, interval)
        quantum = max(QUANTUM_SHARE * self._typical, 1e-6)
        return np.floor(np.abs(now - self._last[slots] - interval) / quantum)

    def _order(self, k: int, now: float) -> list[tuple[int, int]]:
        """(slot, generation) of at least the k resident slots to evict first, the first last
        (to pop); all of a tie at the k-th are in."""
        self._typical = self.typical_interval(now)
        slots = np.flatnonzero(self._resident)
        if not len(slots):
            return []
        score = self._scores(slots, now)
        if k < len(slots):
            kth = np.partition(score, len(slots) - k)[len(slots) - k]
            top = score >= kth
            slots, score = slots[top], score[top]
        order = np.lexsort((-self._last[slots], self._depth[slots], score))
        chosen = slots[order]
        return list(zip(chosen.tolist(), self._gen[chosen].tolist(), strict=True))

    def _used(self, last: float, interval: float, now: float) -> tuple[float, float]:
        """A block's (last use, interval) after a use at `now`."""
        since = now - last
        if since < SAME_USE_S:
            return last, interval
        if np.isnan(interval):
            return now, since
        return now, 0.5 * (interval + since)

    def _trim_history(self) -> None:
        while len(self._ghosts) > self.history_cap:
            self._ghosts.popitem(last=False)


class NextUse(EvictionPolicy):
    """Evicts the block whose next use is predicted farthest from now (see the module's doc)."""


class LRU(EvictionPolicy):
    """Evicts the block used longest ago; among blocks used at the same time, the deepest."""

    def _scores(self, slots: np.ndarray, now: float) -> np.ndarray:
        return now - self._last[slots]

    def _used(self, last: float, interval: float, now: float) -> tuple[float, float]:
        return now, interval


def make_policy(
    policy: Policy,
    num_slots: int = 0,
    clock: Callable[[], float] = time.monotonic,
    history: int | None = None,
) -> EvictionPolicy:
    """The policy named `policy` ("next-use" or "lru")."""
    if policy == "next-use":
        return NextUse(num_slots, clock, history)
    if policy == "lru":
        return LRU(num_slots, clock, history)
    raise ValueError(f"unknown eviction policy {policy!r}; expected one of {', '.join(POLICIES)}")
