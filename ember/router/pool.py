"""The router's endpoints and what it keeps learning about them: health, each engine's `/load`, and
its KV events (for the prefix index), polled in the background; plus the choice of an endpoint for
one leg of a request (session affinity with bounded load, else least cost with prefix credit).

A poll whose answer was lost (a timeout, a dropped connection) marks its engine down only after
`down_after` in a row; a refused connection (nothing listens: the engine is gone), an error status
or "not ready" mark it down at once. Failed requests count in each engine's circuit breaker."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Set
from dataclasses import dataclass, field

import aiohttp

from ember.router.affinity import SessionAffinity
from ember.router.breaker import CircuitBreaker
from ember.router.cost import choose, request_cost
from ember.router.endpoint import Endpoint, LoadReport, NoEndpointError
from ember.router.prefix_index import PrefixIndex
from ember.router.prompt import PromptInfo

log = logging.getLogger(__name__)

MAX_EVENT_PAGES = 64
"""Pages of KV events one poll fetches at most; the next poll goes on from there."""
PROGRESS_KEYS = (
    "running",
    "waiting",
    "in_flight",
    "prefill_tokens",
    "decode_tokens",
    "prefix_cache_queries",
    "kv_event_seq",
    "remote_kv_loads",
)
"""Keys of an engine's `/load` of which one changes whenever the engine does work (a step, a new
request, a KV read): how the router tells a queue that moves from an engine that hangs."""
DOWN_AFTER_LOST_POLLS = 3
"""Polls in a row whose answer was lost that take an engine out of rotation: one reset connection
or slow answer on a busy host is noise, not a dead engine."""
LOST_ANSWER = (
    TimeoutError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientPayloadError,
    aiohttp.ClientOSError,  # a reset connection (a refused one is its subclass, caught first)
)
"""How a poll's answer gets lost on the way from a process that may well be alive."""


@dataclass(slots=True)
class EngineInfo:
    """What an engine says about its KV cache in `/load`: how to hash prompts the way it does."""

    kv_root_hash: bytes = b""
    block_size: int = 16
    event_seq: int = 0
    engine_id: str = ""


@dataclass(slots=True)
class Choice:
    endpoint: Endpoint
    uncached_tokens: int
    cached_tokens: int
    """The router's estimate of the prompt tokens the endpoint has cached."""
    reason: str
    """"affinity" or "cost"."""


@dataclass(slots=True)
class EndpointPool:
    endpoints: dict[str, Endpoint]
    poll_s: float = 0.5
    epsilon: float = 0.25
    rng: random.Random = field(default_factory=random.Random)
    breakers: dict[str, CircuitBreaker] = field(default_factory=dict)
    info: dict[str, EngineInfo] = field(default_factory=dict)
    prefix: PrefixIndex = field(default_factory=PrefixIndex)
    rings: dict[str, SessionAffinity] = field(default_factory=dict)
    down_after: int = DOWN_AFTER_LOST_POLLS
    """Polls in a row with a lost answer (LOST_ANSWER) that mark an engine down."""
    lost_polls: dict[str, int] = field(default_factory=dict)
    """Per endpoint: polls in a row whose answer was lost (reset by any whole answer)."""

    def __post_init__(self) -> None:
        if self.down_after < 1:
            raise ValueError(f"down_after must be >= 1, got {self.down_after}")

    @classmethod
    def build(
        cls, prefill: list[str], decode: list[str], both: list[str], **kw: object
    ) -> EndpointPool:
        eps: dict[str, Endpoint] = {}
        for role, urls in (("prefill", prefill), ("decode", decode), ("both", both)):
            for url in urls:
                url = url.rstrip("/")
                if url in eps:
                    raise ValueError(f"endpoint {url} is listed twice")
                eps[url] = Endpoint(url, role, healthy=False)
        if not eps:
            raise ValueError("the router needs at least one endpoint")
        pool = cls(eps, **kw)  # type: ignore[arg-type]
        for url in eps:
            pool.breakers[url] = CircuitBreaker()
            pool.info[url] = EngineInfo()
        # One ring per leg: prefill-capable and decode-capable endpoints.
        pool.rings["prefill"] = SessionAffinity(u for u, e in eps.items() if e.role != "decode")
        pool.rings["decode"] = SessionAffinity(u for u, e in eps.items() if e.role != "prefill")
        return pool

    # -- choosing ----------------------------------------------------------------------------

    def has_role(self, role: str) -> bool:
        return any(e.role == role for e in self.endpoints.values())

    def candidates(self, leg: str, exclude: Set[str] = frozenset()) -> list[Endpoint]:
        """Healthy endpoints that can serve a leg ("prefill" or "decode") and whose breaker lets a
        request through."""
        wrong = "decode" if leg == "prefill" else "prefill"
        return [
            e
            for e in self.endpoints.values()
            if e.role != wrong
            and e.healthy
            and e.url not in exclude
            and self.breakers[e.url].available  # allow() is taken by the endpoint chosen
        ]

    def cached_tokens(self, prompt: PromptInfo, urls: list[str]) -> dict[str, int]:
        """Prompt tokens each endpoint holds in its prefix cache, from the index of KV events."""
        out = dict.fromkeys(urls, 0)
        # Engines hash with their own root and block size: hash the prompt once per layout.
        by_layout = {(self.info[u].kv_root_hash, self.info[u].block_size) for u in urls}
        for root, bs in by_layout:
            hashes = prompt.hashes(root, bs)
            if not hashes:
                continue
            for u, blocks in self.prefix.match(hashes).items():
                if u in out:
                    out[u] = min(blocks * bs, max(prompt.num_tokens - 1, 0))
        return out

    def choose(
        self,
        leg: str,
        prompt: PromptInfo,
        session: str | None,
        exclude: Set[str] = frozenset(),
    ) -> Choice:
        cands = self.candidates(leg, exclude)
        if not cands:
            raise NoEndpointError(f"no healthy endpoint can take the {leg} leg")
        cached = self.cached_tokens(prompt, [e.url for e in cands])
        uncached = {u: max(prompt.num_tokens - c, 0) for u, c in cached.items()}
        decode_tokens = prompt.num_tokens if leg == "decode" else 0
        by_url = {e.url: e for e in cands}
        if session:
            loads = {u: request_cost(e, uncached[u], decode_tokens) for u, e in by_url.items()}
            url = self.rings[leg].choose(session, loads, self.epsilon)
            return Choice(by_url[url], uncached[url], cached[url], "affinity")
        ep = choose(
            cands, new_prefill_tokens=uncached, rng=self.rng, new_decode_tokens=decode_tokens
        )
        return Choice(ep, uncached[ep.url], cached[ep.url], "cost")

    # -- learning ----------------------------------------------------------------------------

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Poll every endpoint's /load and /kv_events until cancelled."""
        while True:
            await asyncio.gather(*(self.poll(session, e) for e in self.endpoints.values()))
            await asyncio.sleep(self.poll_s)

    async def poll(self, session: aiohttp.ClientSession, ep: Endpoint) -> None:
        """One poll of the endpoint, and what it says about its health."""
        try:
            await self._poll(session, ep)
        except aiohttp.ClientConnectorError as e:  # refused: no process listens, the engine is gone
            self._mark_down(ep, e)
        except LOST_ANSWER as e:
            lost = self.lost_polls.get(ep.url, 0) + 1
            self.lost_polls[ep.url] = lost
            if lost >= self.down_after:
                self._mark_down(ep, e)
            else:
                log.info("poll of %s lost (%d of %d): %r", ep.url, lost, self.down_after, e)
        except (aiohttp.ClientError, ValueError, KeyError) as e:  # an error status, not ready ...
            self._mark_down(ep, e)
        else:
            self.lost_polls[ep.url] = 0
            if not ep.healthy:
                log.info("endpoint %s (%s) is up", ep.url, ep.role)
            ep.healthy = True

    def _mark_down(self, ep: Endpoint, why: Exception) -> None:
        if ep.healthy:
            log.warning("endpoint %s is down: %r", ep.url, why)
        ep.healthy = False

    async def _poll(self, session: aiohttp.ClientSession, ep: Endpoint) -> None:
        """GET /load (and /kv_events when the engine has new ones); raises when it fails."""
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.poll_s * 4))
        info = self.info[ep.url]
        async with session.get(f"{ep.url}/load", timeout=timeout) as r:
            if r.status != 200:
                raise ValueError(f"/load answered {r.status}")
            body = await r.json()
        if not body.get("ready"):
            raise ValueError("not ready")
        now = time.monotonic()
        ep.apply_report(LoadReport.from_load_json(body, now))
        ep.note_progress(tuple(body.get(k) for k in PROGRESS_KEYS), now)
        engine_id = body.get("engine_id", "")
        if engine_id != info.engine_id:  # a new engine behind the url: its cache is new too
            self.prefix.forget(ep.url)
            info.engine_id, info.event_seq = engine_id, 0
        info.kv_root_hash = bytes.fromhex(body.get("kv_root_hash", ""))
        info.block_size = int(body.get("block_size", 16))
        if body.get("kv_event_seq", 0) != info.event_seq:
            await self._events(session, ep, info, timeout)

    async def _events(
        self,
        session: aiohttp.ClientSession,
        ep: Endpoint,
        info: EngineInfo,
        timeout: aiohttp.ClientTimeout,
    ) -> None:
        """Fetch the events since the last applied one; an engine may page them (`"more": true`),
        so keep fetching from the last seq until it has none left (bounded, to end a poll)."""
        for _ in range(MAX_EVENT_PAGES):
            async with session.get(
                f"{ep.url}/kv_events", params={"since": info.event_seq}, timeout=timeout
            ) as r:
                if r.status != 200:
                    raise ValueError(f"/kv_events answered {r.status}")
                body = await r.json()
            if body.get("lost"):
                self.prefix.forget(ep.url)
            # Runs of one kind keep the order that matters (a hash evicted, then stored again).
            run_kind, run = "", []
            for kind, h in body.get("events", []):
                if kind != run_kind and run:
                    self._apply(ep.url, run_kind, run)
                    run = []
                run_kind = kind
                run.append(bytes.fromhex(h))
            if run:
                self._apply(ep.url, run_kind, run)
            seq = int(body.get("seq", info.event_seq))
            advanced = seq != info.event_seq
            info.event_seq = seq
            if not body.get("more") or not advanced:
                return

    def _apply(self, url: str, kind: str, hashes: list[bytes]) -> None:
        if kind == "stored":
            self.prefix.apply(url, hashes, [])
        else:
            self.prefix.apply(url, [], hashes)
