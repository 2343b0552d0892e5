"""Session affinity: `x-session-affinity` ids map to endpoints by consistent hashing with bounded
loads (Mirrokni, Thorup, Zadimoghaddam 2018), so a session's turns find their prompt cache unless
its endpoint is overloaded, and a lost endpoint moves only its own sessions."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Iterator, Mapping

from ember.router.endpoint import NoEndpointError

VNODES = 100
"""Ring points per endpoint: each one's share of sessions stays within about ±20% of even."""


def ring_point(key: str) -> int:
    """A 64-bit position on the ring; blake2b so it is the same in every process (never hash())."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class SessionAffinity:
    """A hash ring over endpoint urls, `vnodes` points each."""

    __slots__ = ("_vnodes", "_urls", "_points", "_owners")

    def __init__(self, urls: Iterable[str] = (), *, vnodes: int = VNODES) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self._vnodes = vnodes
        self._urls: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []
        for url in urls:
            self.add(url)

    @property
    def urls(self) -> frozenset[str]:
        return frozenset(self._urls)

    def __len__(self) -> int:
        return len(self._urls)

    def __contains__(self, url: object) -> bool:
        return url in self._urls

    def add(self, url: str) -> None:
        """Put `url` on the ring (no-op if it is there). It takes over only sessions of its points."""
        if url in self._urls:
            return
        self._urls.add(url)
        self._rebuild()

    def remove(self, url: str) -> None:
        """Take `url` off the ring (no-op if absent). Only its sessions move, each to its successor."""
        if url not in self._urls:
            return
        self._urls.discard(url)
        self._rebuild()

    def _rebuild(self) -> None:
        # Sorting (point, url) makes the ring independent of the order urls were added in, even
        # in the (2^-64) case of two urls sharing a point.
        ring = sorted(
            (ring_point(f"{url}#{i}"), url) for url in self._urls for i in range(self._vnodes)
        )
        self._points = [p for p, _ in ring]
        self._owners = [u for _, u in ring]

    def preference_list(self, session_id: str) -> list[str]:
        """Every url once, in ring order from the session's point: its owner first, then the
        successors that would inherit the session, in turn, if the ones before were removed."""
        return list(self._walk(session_id))

    def _walk(self, session_id: str) -> Iterator[str]:
        if not self._owners:
            raise NoEndpointError("the affinity ring is empty")
        start = bisect.bisect_right(self._points, ring_point(session_id))
        n = len(self._owners)
        seen: set[str] = set()
        for k in range(n):
            url = self._owners[(start + k) % n]
            if url not in seen:
                seen.add(url)
                yield url
                if len(seen) == len(self._urls):
                    return

    def lookup(self, session_id: str) -> str:
        """The ring's owner of the session, regardless of health or load."""
        return next(self._walk(session_id))

    def choose(self, session_id: str, loads: Mapping[str, float], epsilon: float = 0.25) -> str:
        """The first endpoint on the session's ring walk with load <= (1 + epsilon) * mean load.

        `loads` holds the healthy candidates (non-negative, e.g. `cost.request_cost`); ring urls
        missing from it are skipped, and its urls not on the ring are ignored. The mean is over
        the candidates, so an idle cluster (all zero) never rejects and the least-loaded candidate
        always qualifies; the least-loaded one is also the fallback should float rounding with
        epsilon = 0 reject them all.
        """
        if epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon}")
        candidates = [u for u in loads if u in self._urls]
        if not candidates:
            raise NoEndpointError("no healthy endpoint on the affinity ring")
        bound = (1.0 + epsilon) * sum(loads[u] for u in candidates) / len(candidates)
        for url in self._walk(session_id):
            if url in loads and loads[url] <= bound:
                return url
        return min(candidates, key=lambda u: loads[u])
