"""Opening one leg of a request on an engine: the POST (with no fixed read timeout), liveness while
a whole answer is awaited (the engine must keep answering `/load`), one retry of a stale pooled
connection, and the retry policy across endpoints (an engine's failure or full queue is tried
elsewhere; an answer that is the request's own fault is final)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

import aiohttp
import orjson

from ember.openai_errors import FAULT_HEADER
from ember.router.endpoint import Endpoint, NoEndpointError
from ember.router.metrics import RouterMetrics
from ember.router.pool import Choice, EndpointPool
from ember.router.prompt import PromptInfo

log = logging.getLogger(__name__)

T = TypeVar("T")

WHOLE_LEG_LIMIT_S = 3600.0
"""A whole answer from an engine that keeps answering /load may take this long (a safety net)."""


class LegError(Exception):
    """An endpoint failed before it sent anything: the leg may be retried elsewhere."""


class Legs:
    def __init__(
        self,
        pool: EndpointPool,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        max_attempts: int = 3,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.session = session
        """Carries the cluster secret on every call (see app.py)."""
        self.max_attempts = max_attempts

    def post(self, ep: Endpoint, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        return self.session.post(
            ep.url + path,
            data=orjson.dumps(body),
            headers={**headers, "content-type": "application/json"},
            # No read timeout: liveness is judged by the engine's /load (see alive) and, for a
            # stream, by the bytes it sends (see proxy.Router._relay).
            timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_read=None),
        )

    async def alive(self, ep: Endpoint, aw: Awaitable[T]) -> T:
        """Await an engine's answer for as long as the engine is alive: its /load keeps answering
        the pool's poller (a stopped or hung engine is marked down within a few polls). A queued
        or long prefill is not cut by a fixed timeout."""
        task = asyncio.ensure_future(aw)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WHOLE_LEG_LIMIT_S
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=max(self.pool.poll_s, 0.05))
                if done:
                    return task.result()
                if not ep.healthy:
                    raise LegError(f"{ep.url} stopped answering /load")
                if loop.time() > deadline:
                    raise LegError(f"{ep.url} took over {WHOLE_LEG_LIMIT_S:.0f} s")
        finally:
            if not task.done():
                task.cancel()

    async def open(
        self, ep: Endpoint, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """POST a leg. A pooled keep-alive connection the engine had already closed fails before
        any byte (ServerDisconnectedError): that is retried once on the same endpoint."""
        for attempt in (0, 1):
            try:
                return await self.alive(ep, self.post(ep, path, body, headers).__aenter__())
            except aiohttp.ServerDisconnectedError:
                if attempt:
                    raise
                log.info("stale connection to %s: retrying once", ep.url)
        raise AssertionError("unreachable")

    async def read_whole(self, resp: aiohttp.ClientResponse, ep: Endpoint) -> bytes:
        try:
            return await self.alive(ep, resp.read())
        except (TimeoutError, aiohttp.ClientError) as e:
            self.pool.breakers[ep.url].record_failure()
            raise LegError(f"the answer from {ep.url} broke off: {e}") from e
        finally:
            resp.release()

    async def send(
        self,
        leg: str,
        path: str,
        body: dict[str, Any],
        prompt: PromptInfo,
        session: str | None,
        headers: dict[str, str],
        first: Choice | None = None,
    ) -> tuple[aiohttp.ClientResponse, Choice]:
        """Open a streamed or whole leg on `first` (or the pool's choice). Retried elsewhere only
        when the engine failed (no answer, or its own 5xx) or its queue was full (429); anything
        else, a 4xx or an answer marked as the request's fault, is the answer."""
        tried: set[str] = set()
        last = "no endpoint answered"
        busy: tuple[aiohttp.ClientResponse, Choice] | None = None
        for attempt in range(self.max_attempts):
            if attempt == 0 and first is not None:
                choice = first
            else:
                try:
                    choice = self.pool.choose(leg, prompt, session, exclude=tried)
                except NoEndpointError:
                    if attempt == 0:
                        raise
                    break
            if attempt:
                self.metrics.retries.labels(leg).inc()
            ep = choice.endpoint
            tried.add(ep.url)
            # A prefill leg's uncached tokens count against its endpoint until its answer comes
            # (a whole answer: the headers arrive when the prefill is done).
            queued = choice.uncached_tokens if leg == "prefill" else 0
            ep.add_load(prefill_tokens=queued, requests=int(leg == "prefill"))
            try:
                resp = await self.open(ep, path, body, headers)
            except (TimeoutError, aiohttp.ClientError, LegError) as e:
                self.pool.breakers[ep.url].record_failure()
                log.warning("%s leg on %s failed: %s", leg, ep.url, e)
                last = f"{ep.url}: {e}"
                continue
            finally:
                ep.remove_load(prefill_tokens=queued, requests=int(leg == "prefill"))
            if resp.status == 429:
                # A full queue is not a failure: try another engine, else pass the 429 on.
                self.pool.breakers[ep.url].record_success()
                if busy is not None:
                    busy[0].release()
                busy = (resp, choice)
                continue
            if resp.status >= 500 and resp.headers.get(FAULT_HEADER) != "request":
                self.pool.breakers[ep.url].record_failure()
                last = f"{ep.url} answered {resp.status}"
                resp.release()
                continue
            self.pool.breakers[ep.url].record_success()
            if busy is not None:
                busy[0].release()
            return resp, choice
        if busy is not None:
            return busy
        raise LegError(last)
