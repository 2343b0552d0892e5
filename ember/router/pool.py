"""The router's endpoints and what it keeps learning about them: health, each engine's `/load`, and
its KV events (for the prefix index), polled in the background; plus the choice of an endpoint for
one leg of a request (session affinity with bounded load, else least cost with prefix credit).

Prefix credit follows the engine's own lookup: the blocks on its GPU, then those in its host and
disk tiers (from its KV events' medium), then those in the KV store it shares (`kv_store` in its
`/load`), each going on where the one before stopped. A token loaded from a tier costs a share of
a prefilled one (`endpoint.TIER_LOAD_WEIGHT`).

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
from ember.router.endpoint import TIER_LOAD_WEIGHT, Endpoint, LoadReport, NoEndpointError
from ember.router.prefix_index import PrefixIndex, StoreIndex
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
TIER_MEDIA = ("cpu", "disk")
"""An engine's own KV tiers below its GPU, in the order it looks them up."""
TIER_INDEX_MAX_BLOCKS = 1 << 18
"""Blocks the index keeps per engine and tier (about 30 MiB of router memory each): a disk tier
may hold millions of small blocks, and the oldest matter least."""
STORE_CREDIT_TTL_S = 600.0
"""How long a block reported written to a shared store counts as there (see `StoreIndex`)."""
STORE_INDEX_MAX_BLOCKS = 1 << 18
"""Blocks the index keeps per shared store."""


@dataclass(slots=True)
class EngineInfo:
    """What an engine says about its KV cache in `/load`: how to hash prompts the way it does."""

    kv_root_hash: bytes = b""
    block_size: int = 16
    event_seq: int = 0
    engine_id: str = ""
    kv_store: str = ""
    """The KV store the engine writes through to and loads from (its `--kv-store`), or ""."""
    max_prompt_chars: int = 0
    """Characters past which no prompt fits the engine's context (0: not known yet)."""


@dataclass(slots=True)
class Credit:
    """Prompt tokens an endpoint would not prefill, by the medium it would take them from."""

    tokens: dict[str, int] = field(default_factory=dict)

    @property
    def cached(self) -> int:
        return sum(self.tokens.values())

    @property
    def load_cost(self) -> float:
        """The cost of loading them, in prefilled tokens (TIER_LOAD_WEIGHT per medium)."""
        return sum(TIER_LOAD_WEIGHT[m] * t for m, t in self.tokens.items())


@dataclass(slots=True)
class Choice:
    endpoint: Endpoint
    uncached_tokens: int
    cached_tokens: int
    """The router's estimate of the prompt tokens the endpoint has cached, in any medium."""
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
    """Blocks on each engine's GPU."""
    tiers: dict[str, PrefixIndex] = field(
        default_factory=lambda: {m: PrefixIndex(TIER_INDEX_MAX_BLOCKS) for m in TIER_MEDIA}
    )
    """Blocks in each engine's own tiers below the GPU, by medium."""
    store: StoreIndex = field(
        default_factory=lambda: StoreIndex(STORE_CREDIT_TTL_S, STORE_INDEX_MAX_BLOCKS)
    )
    """Blocks in the shared KV stores, which every engine on that store may load."""
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

    def max_prompt_chars(self) -> int:
        """The longest prompt, in characters, that some decode-capable engine could fit (their
        largest `max_prompt_chars`); 0 while no engine has said."""
        return max(
            (
                self.info[e.url].max_prompt_chars
                for e in self.endpoints.values()
                if e.role != "prefill"
            ),
            default=0,
        )

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
        """Prompt tokens each endpoint would not prefill, from any medium."""
        return {u: c.cached for u, c in self.credit(prompt, urls).items()}

    def credit(
        self, prompt: PromptInfo, urls: list[str], now: float | None = None
    ) -> dict[str, Credit]:
        """Per endpoint, the prompt tokens it holds by medium, as it would look them up: its GPU's
        prefix, then its host and disk tiers, then its store, each from where the one before
        stopped. The last prompt token is always computed, so it never counts."""
        now = time.monotonic() if now is None else now
        out = {u: Credit() for u in urls}
        cap = max(prompt.num_tokens - 1, 0)
        down = {u for u, e in self.endpoints.items() if not e.healthy}
        # Engines hash with their own root and block size: hash the prompt once per layout.
        layouts: dict[tuple[bytes, int], list[str]] = {}
        for u in urls:
            layouts.setdefault((self.info[u].kv_root_hash, self.info[u].block_size), []).append(u)
        for (root, bs), group in layouts.items():
            hashes = prompt.hashes(root, bs)
            if not hashes:
                continue
            pos = dict.fromkeys(group, 0)
            blocks: dict[str, dict[str, int]] = {u: {} for u in group}
            for medium, index in (("gpu", self.prefix), *self.tiers.items()):
                for off in set(pos.values()):
                    if off == len(hashes):
                        continue
                    found = index.match(hashes[off:])
                    for u in (u for u in group if pos[u] == off and found.get(u)):
                        blocks[u][medium] = found[u]
                        pos[u] += found[u]
            for u in group:
                store = self.info[u].kv_store
                if store and pos[u] < len(hashes):
                    n = self.store.match(store, hashes[pos[u] :], now, skip_writers=down)
                    if n:
                        blocks[u]["store"] = n
            for u in group:
                left = cap
                for medium, n in blocks[u].items():
                    t = min(n * bs, left)
                    if t:
                        out[u].tokens[medium] = t
                    left -= t
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
        credit = self.credit(prompt, [e.url for e in cands])
        cached = {u: c.cached for u, c in credit.items()}
        uncached = {u: max(prompt.num_tokens - c, 0) for u, c in cached.items()}
        # What the cost sees: the tokens to prefill, plus the tier tokens to load at their weight.
        work = {u: uncached[u] + credit[u].load_cost for u in uncached}
        decode_tokens = prompt.num_tokens if leg == "decode" else 0
        by_url = {e.url: e for e in cands}
        if session:
            loads = {u: request_cost(e, work[u], decode_tokens) for u, e in by_url.items()}
            url = self.rings[leg].choose(session, loads, self.epsilon)
            return Choice(by_url[url], uncached[url], cached[url], "affinity")
        ep = choose(cands, new_prefill_tokens=work, rng=self.rng, new_decode_tokens=decode_tokens)
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
            self._forget(ep.url)
            self.store.forget_writer(ep.url)  # its store segment went with the old process
            info.engine_id, info.event_seq = engine_id, 0
        info.kv_root_hash = bytes.fromhex(body.get("kv_root_hash", ""))
        info.block_size = int(body.get("block_size", 16))
        info.kv_store = str(body.get("kv_store") or "")
        info.max_prompt_chars = int(body.get("max_prompt_chars") or 0)
        if body.get("kv_event_seq", 0) != info.event_seq:
            await self._events(session, ep, info, timeout)

    async def _events(
        self,
        session: aiohttp.ClientSession,
        ep: Endpoint,
        info: EngineInfo,
        timeout: aiohttp.ClientTimeout,
    ) -> None:
        """Fetch the events since the last applied one, of every medium (`[kind, hash, medium]`;
        an engine without tiers sends `[kind, hash]`, its GPU's); an engine may page them
        (`"more": true`), so keep fetching from the last seq until it has none left (bounded, to
        end a poll)."""
        params = {"medium": "all"}
        for _ in range(MAX_EVENT_PAGES):
            params["since"] = str(info.event_seq)
            async with session.get(f"{ep.url}/kv_events", params=params, timeout=timeout) as r:
                if r.status != 200:
                    raise ValueError(f"/kv_events answered {r.status}")
                body = await r.json()
            if body.get("lost"):
                self._forget(ep.url)
            # Runs of one kind and medium keep the order that matters (a hash evicted, then
            # stored again).
            now = time.monotonic()
            run_key, run = ("", ""), []
            for kind, h, *medium in body.get("events", []):
                key = (kind, medium[0] if medium else "gpu")
                if key != run_key and run:
                    self._apply(ep.url, *run_key, run, now)
                    run = []
                run_key = key
                run.append(bytes.fromhex(h))
            if run:
                self._apply(ep.url, *run_key, run, now)
            seq = int(body.get("seq", info.event_seq))
            advanced = seq != info.event_seq
            info.event_seq = seq
            if not body.get("more") or not advanced:
                return

    def _apply(self, url: str, kind: str, medium: str, hashes: list[bytes], now: float) -> None:
        """One run of `url`'s events. A block an engine on a store reports stored, whatever the
        medium, is written through to that store too: credit it there for every engine on it.
        Nothing reports a block leaving a shared store (see `StoreIndex`)."""
        index = self.prefix if medium == "gpu" else self.tiers.get(medium)
        if kind == "stored":
            if index is not None:
                index.apply(url, hashes, [])
            store = self.info[url].kv_store
            if store:
                self.store.add(store, url, hashes, now)
        elif index is not None:
            index.apply(url, [], hashes)

    def _forget(self, url: str) -> None:
        """Drop what `url` holds itself (GPU and tiers); its store blocks are the store's."""
        self.prefix.forget(url)
        for index in self.tiers.values():
            index.forget(url)
