"""One request through the router: pick endpoints, run the prefill leg and then the decode leg (or
one colocated leg), relay the stream, rewrite the usage, and end cleanly whatever fails.

- The client's body is the public face: `kv_transfer_params` are dropped from it, and only the
  router's own calls (with the cluster secret on the session) carry internal fields and headers.
- A leg that fails before its first byte (connection refused, an engine's own 5xx) is retried on
  another endpoint; an answer that failed for the request's own reason (a 4xx, `x-ember-fault:
  request`) is the client's as it is. A 429 (the engine's queue is full) is tried elsewhere first.
- No fixed read timeout: a whole answer is awaited while its engine keeps answering `/load`; a
  stream that sends nothing for `stall_timeout_s` while its engine does no work either (its `/load`
  counters stand still) ends with an error event and `[DONE]`.
- When no prefill engine can take a leg, a decode engine prefills in place. A request that asks
  for logprobs (of its first token, or of its prompt: `echo`, `prompt_logprobs`) runs in one leg.
- A client that hangs up cancels the handler: open legs are closed (each engine aborts) and the
  prefill lease is released at the prefill endpoint the router chose. A hang-up is never counted
  against an engine's circuit breaker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from ember.router.answers import DONE, as_chunks, cached_tokens, set_cached, sse
from ember.router.endpoint import Endpoint, NoEndpointError
from ember.router.errors import PASSED_HEADERS, error_body, error_response
from ember.router.legs import LegError, Legs
from ember.router.metrics import RouterMetrics
from ember.router.pool import Choice, EndpointPool
from ember.router.prompt import PromptInfo, PromptReader, prompt_chars
from ember.trust import TENANT_HEADER, Tenant, TenantKeys, cache_namespace

log = logging.getLogger(__name__)


FORWARDED_HEADERS = ("x-session-affinity", "x-session-id", "x-request-id")
"""The client's headers an engine sees; never its Authorization nor any x-ember-* header."""
CLIENT_ONLY_FIELDS = ("kv_transfer_params",)
"""Internal request fields: a client's are dropped, only the router sets them."""
MAX_BODY_DEPTH = 128
"""A body nested deeper is refused here: orjson cannot encode past 254 levels, and the engines
take no field nested past 64 (their message names the field)."""
OFFLOAD_BYTES = 64 << 10
"""Bodies above this are parsed and tokenized in a thread, so a big prompt stalls no stream."""


class Refused(Exception):
    """The engine turned the request down: the client gets that answer as it is."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


class Router:
    def __init__(
        self,
        pool: EndpointPool,
        prompts: PromptReader,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        disagg_min_uncached: int = 256,
        max_attempts: int = 3,
        *,
        keys: TenantKeys | None = None,
        stall_timeout_s: float = 30.0,
    ) -> None:
        self.pool = pool
        self.prompts = prompts
        self.metrics = metrics
        self.session = session
        """Carries the cluster secret on every call (see app.py): only engines are called."""
        self.disagg_min_uncached = disagg_min_uncached
        self.legs = Legs(pool, metrics, session, max_attempts)
        self.keys = keys or TenantKeys()
        self.stall_timeout_s = stall_timeout_s

    # -- entry -------------------------------------------------------------------------------

    async def handle(
        self,
        request: web.Request,
        path: str,
        chat: bool,
        tenant: Tenant | None = None,
        checked: dict[str, str] | None = None,
    ) -> web.StreamResponse:
        """`checked`: the request's headers as `trust.checked_headers` read them (one of each,
        text, bounded); the only ones the router forwards or routes by."""
        raw = await request.read()  # bounded by the app's client_max_size (413 above it)
        big = len(raw) > OFFLOAD_BYTES
        try:
            body = await asyncio.to_thread(orjson.loads, raw) if big else orjson.loads(raw)
        except orjson.JSONDecodeError:
            return error_response("the request body is not valid JSON", 400)
        if not isinstance(body, dict):
            return error_response("the request body must be a JSON object", 400)
        if await asyncio.to_thread(_too_deep, body) if big else _too_deep(body):
            return error_response(f"the request body nests past {MAX_BODY_DEPTH} levels", 400)
        for name in CLIENT_ONLY_FIELDS:
            body.pop(name, None)
        checked = checked or {}
        headers = {k: v for k, v in checked.items() if k in FORWARDED_HEADERS}
        namespace = self.keys.namespace(tenant)
        if namespace:
            headers[TENANT_HEADER] = namespace
        given_salt = body.get("cache_salt")
        salt = cache_namespace(namespace, given_salt if isinstance(given_salt, str) else None)
        session = checked.get("x-session-affinity") or checked.get("x-session-id")
        # As `ember serve` does: a text that cannot fit the context is refused before it is
        # tokenized (a 30 MB chat once took the router from 66 MB to 2.96 GB, and kept it).
        limit = self.pool.max_prompt_chars()
        size = prompt_chars(body, chat)
        if limit and size > limit:
            return error_response(
                f"a prompt of {size} characters cannot fit this model's context (the limit is "
                f"{limit} characters)",
                400,
                code="context_length_exceeded",
            )
        if big:
            prompt = await asyncio.to_thread(self.prompts.read, body, chat, salt)
        else:
            prompt = self.prompts.read(body, chat, salt)
        self.metrics.prompt_tokens.inc(prompt.num_tokens)
        p = self._prefill_choice(body, prompt, session)
        if p is None:
            return await self._colocated(request, path, body, prompt, session, headers)
        return await self._disaggregated(request, path, body, prompt, session, headers, p)

    def _prefill_choice(
        self, body: dict[str, Any], prompt: PromptInfo, session: str | None
    ) -> Choice | None:
        """The prefill endpoint when the request should be split; None to run it in one place."""
        if not self.pool.has_role("prefill") or body.get("n", 1) != 1 or prompt.batch:
            return None
        if _scores_on_one_engine(body):
            return None
        prompt_field = body.get("prompt")
        if isinstance(prompt_field, list) and prompt_field and isinstance(prompt_field[0], list):
            return None  # a batch of prompts
        try:
            p = self.pool.choose("prefill", prompt, session)
        except NoEndpointError:
            return None  # decode-capable endpoints can still prefill locally
        if session is not None:
            # A session's every turn takes its prefill leg on the session's prefill engine, short
            # or not, so that the session's KV grows in one place: that engine's prefix cache then
            # holds every earlier turn's prompt, a short turn costs it little (most is cached), and
            # the decode engine reads only the blocks it lacks. Run in place on a decode engine, a
            # short turn left a hole that the next long turn's prefill recomputed.
            return p
        if p.uncached_tokens < self.disagg_min_uncached:
            return None  # conditional disaggregation: a short uncached part is cheaper in place
        return p

    # -- colocated -----------------------------------------------------------------------------

    async def _colocated(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        prompt: PromptInfo,
        session: str | None,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        try:
            upstream, choice = await self.legs.send("decode", path, body, prompt, session, headers)
        except (LegError, NoEndpointError) as e:
            self.metrics.failures.labels("before_first_byte").inc()
            return error_response(str(e), 503)
        self.metrics.decisions.labels("colocated", choice.reason).inc()
        self.metrics.cached_estimated.inc(choice.cached_tokens)
        resp, _ = await self._relay(
            request, upstream, choice.endpoint, None, decode_tokens=prompt.num_tokens
        )
        return resp

    # -- disaggregated ---------------------------------------------------------------------------

    async def _disaggregated(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        prompt: PromptInfo,
        session: str | None,
        headers: dict[str, str],
        first: Choice,
    ) -> web.StreamResponse:
        prefill_body = {k: v for k, v in body.items() if k != "stream_options"}
        prefill_body.update(stream=False, kv_transfer_params={"do_remote_decode": True})
        try:
            presp, pep = await self._prefill(path, prefill_body, prompt, session, headers, first)
        except Refused as e:
            return e.response
        except (LegError, NoEndpointError) as e:
            # No prefill engine could take it: a decode engine prefills in place (slower than a
            # split, far better than a 503 while decode engines are healthy).
            log.warning("prefill leg failed (%s): the decode engine prefills in place", e)
            self.metrics.failures.labels("prefill_fallback").inc()
            return await self._colocated(request, path, body, prompt, session, headers)
        kvp = presp.get("kv_transfer_params")
        cached = cached_tokens(presp)
        self.metrics.decisions.labels("pd", first.reason).inc()
        self.metrics.cached_estimated.inc(first.cached_tokens)
        if not isinstance(kvp, dict) or _max_tokens(body) == 1:
            # The first token ended it (EOS, a stop id, max_tokens=1): nothing left to decode.
            if isinstance(kvp, dict):
                self._release_soon(pep, kvp)
            return await self._answer_from_prefill(request, presp, body, cached)
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = {
            **kvp,
            "do_remote_prefill": True,
            "do_remote_decode": False,
        }
        finished = False
        try:
            try:
                upstream, d = await self.legs.send(
                    "decode", path, decode_body, prompt, session, headers
                )
            except (LegError, NoEndpointError) as e:
                self.metrics.failures.labels("before_first_byte").inc()
                return error_response(f"decode failed: {e}", 503)
            resp, finished = await self._relay(
                request, upstream, d.endpoint, cached, decode_tokens=prompt.num_tokens
            )
            return resp
        finally:
            # A decode engine that ran the leg to its end released the lease once it had read the
            # blocks. In every other case (turned down, client gone, engine stalled or dead) the
            # router releases it: a decode engine still reading then finds it gone and does not
            # trust what it read, so an early release is safe and a missed one holds blocks.
            if not finished:
                self._release_soon(pep, kvp)

    async def _prefill(
        self,
        path: str,
        body: dict[str, Any],
        prompt: PromptInfo,
        session: str | None,
        headers: dict[str, str],
        first: Choice,
    ) -> tuple[dict[str, Any], Endpoint]:
        """The prefill leg's answer and its endpoint (retried on other prefill endpoints)."""
        resp, choice = await self.legs.send("prefill", path, body, prompt, session, headers, first)
        ep = choice.endpoint
        if resp.status != 200:
            data = await self.legs.read_whole(resp, ep)
            raise Refused(_passed_on(resp, data))
        # The headers of a whole answer come once the prefill is done, so the engine holds a
        # lease now: if the client hangs up while the body is read, read on and release it.
        reading = asyncio.ensure_future(self.legs.read_whole(resp, ep))
        try:
            data = await asyncio.shield(reading)
        except asyncio.CancelledError:
            reading.add_done_callback(lambda t: self._release_read(t, ep))
            raise
        try:
            answer = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise LegError(f"{ep.url} sent a prefill answer that is not JSON") from e
        if not isinstance(answer, dict):
            raise LegError(f"{ep.url} sent a prefill answer that is not an object")
        return answer, ep

    def _release_read(self, reading: asyncio.Future[bytes], ep: Endpoint) -> None:
        if reading.cancelled() or reading.exception() is not None:
            return
        with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
            kvp = orjson.loads(reading.result()).get("kv_transfer_params")
            if isinstance(kvp, dict):
                self._release_soon(ep, kvp)

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        ep: Endpoint,
        cached: int | None,
        decode_tokens: int,
    ) -> tuple[web.StreamResponse, bool]:
        """Hand an engine's answer to the client, rewriting usage.cached_tokens to the prefill
        side's when `cached` is given; `decode_tokens` count against `ep` meanwhile. Also says
        whether the engine's answer was a success that ran to its end."""
        ep.add_load(decode_tokens=decode_tokens, requests=1)
        try:
            if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                return await self._relay_whole(upstream, ep, cached)
            return await self._relay_stream(request, upstream, ep, cached)
        except asyncio.CancelledError:
            self.metrics.disconnects.inc()
            raise
        finally:
            upstream.close()  # on a client hang-up this aborts the engine's request
            ep.remove_load(decode_tokens=decode_tokens, requests=1)

    async def _relay_whole(
        self, upstream: aiohttp.ClientResponse, ep: Endpoint, cached: int | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            data = await self.legs.read_whole(upstream, ep)
        except LegError as e:
            self.metrics.failures.labels("mid_stream").inc()
            return error_response(str(e), 502), False
        if upstream.status != 200:
            return _passed_on(upstream, data), False
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return error_response(f"{ep.url} sent an answer that is not JSON", 502), False
        if cached is not None:
            set_cached(obj, cached)
            data = orjson.dumps(obj)
        self.metrics.cached_reported.inc(cached_tokens(obj) or 0)
        return web.Response(body=data, status=200, content_type="application/json"), True

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        ep: Endpoint,
        cached: int | None,
    ) -> tuple[web.StreamResponse, bool]:
        resp = web.StreamResponse(
            status=upstream.status,
            headers={"content-type": "text/event-stream", "cache-control": "no-cache"},
        )
        await resp.prepare(request)
        done, failure = False, ""
        while True:
            # Reading the engine and writing to the client fail for different reasons: only the
            # first is the engine's fault (a client that hung up says nothing about the engine).
            try:
                line = await self._next_line(upstream, ep)
            except TimeoutError:
                failure = (
                    f"the engine at {ep.url} sent nothing and did no work "
                    f"for {self.stall_timeout_s:g} s"
                )
                break
            except aiohttp.ClientError as e:
                failure = f"the engine at {ep.url} failed mid-stream"
                log.warning("stream from %s broke: %s", ep.url, e)
                break
            if not line:
                failure = f"the engine at {ep.url} failed mid-stream"
                break
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: {") and b'"usage":{' in line:
                obj = orjson.loads(line[6:])
                if cached is not None:
                    set_cached(obj, cached)
                    line = b"data: " + orjson.dumps(obj) + b"\n"
                self.metrics.cached_reported.inc(cached_tokens(obj) or 0)
            if done:
                line += b"\n"  # the blank line that ends the event: the engine's comes after
            if not await _write(resp, line):
                self.metrics.disconnects.inc()
                return resp, False
            if done:
                break
        if not done:  # the engine stalled or went away: say so, and end the stream properly
            self.metrics.failures.labels("mid_stream").inc()
            self.pool.breakers[ep.url].record_failure()
            log.warning("%s", failure)
            # A blank line first: the engine may have stopped inside an event.
            if await _write(resp, b"\n" + sse(error_body(failure, 502))):
                await _write(resp, DONE)
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp, done

    async def _next_line(self, upstream: aiohttp.ClientResponse, ep: Endpoint) -> bytes:
        """The engine's next line. TimeoutError when it sent nothing for `stall_timeout_s` and
        its `/load` showed no work meanwhile: a request queued behind others in a busy engine
        waits its turn however long, a hung or dead engine is given up on. The read
        is never cancelled while it waits: a cancelled readline would drop a partial line."""
        read = asyncio.ensure_future(upstream.content.readline())
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=self.stall_timeout_s)
                if done:
                    return read.result()
                # The window spans a few polls: a busy engine's counters are seen to move.
                window = max(self.stall_timeout_s, 4 * self.pool.poll_s)
                if not ep.progressing(window, time.monotonic()):
                    raise TimeoutError
        finally:
            if not read.done():
                read.cancel()

    async def _answer_from_prefill(
        self, request: web.Request, presp: dict[str, Any], body: dict[str, Any], cached: int | None
    ) -> web.StreamResponse:
        presp.pop("kv_transfer_params", None)
        if cached is not None:
            set_cached(presp, cached)
        if not body.get("stream"):
            return web.json_response(presp, dumps=lambda o: orjson.dumps(o).decode())
        resp = web.StreamResponse(
            status=200, headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        await resp.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        for chunk in as_chunks(presp, include_usage):
            if not await _write(resp, sse(chunk)):
                return resp
        if await _write(resp, DONE):
            with contextlib.suppress(ConnectionError):
                await resp.write_eof()
        return resp

    def _release_soon(self, prefill: Endpoint, kvp: dict[str, Any]) -> None:
        """Release a prefill lease in the background (also when the handler is being cancelled),
        at the prefill endpoint the router chose: never at a URL taken from an answer."""
        lease_id = kvp.get("lease_id")
        if not isinstance(lease_id, str) or not lease_id:
            return

        async def release() -> None:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with self.session.post(
                    f"{prefill.url}/kv/release",
                    data=orjson.dumps({"lease_id": lease_id}),
                    headers={"content-type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=5),
                ):
                    pass

        task = asyncio.get_running_loop().create_task(release())
        _background.add(task)
        task.add_done_callback(_background.discard)


_background: set[asyncio.Task[None]] = set()


async def _write(resp: web.StreamResponse, data: bytes) -> bool:
    """Write to the client; False when it has hung up ("Cannot write to closing transport")."""
    try:
        await resp.write(data)
    except ConnectionError:  # aiohttp's ClientConnectionResetError is a ConnectionResetError
        return False
    return True


def _passed_on(upstream: aiohttp.ClientResponse, data: bytes) -> web.Response:
    """An engine's error answer as the client gets it: status, body and the headers that matter."""
    headers = {h: upstream.headers[h] for h in PASSED_HEADERS if h in upstream.headers}
    ctype = upstream.headers.get("content-type", "application/json").split(";")[0]
    return web.Response(body=data, status=upstream.status, content_type=ctype, headers=headers)


def _scores_on_one_engine(body: dict[str, Any]) -> bool:
    """Logprobs of the first token (sampled by the prefill leg) or of the prompt (`echo` with
    `logprobs`, `prompt_logprobs`: scored where the prompt is computed) come back only from an
    engine that runs the whole request, so such a request is not split."""
    logprobs = body.get("logprobs")  # 0 asks too (and 0 == False: compare by identity)
    first_token = logprobs is not None and logprobs is not False
    return first_token or body.get("prompt_logprobs") is not None


def _too_deep(value: Any) -> bool:
    """Whether a JSON value nests past MAX_BODY_DEPTH (iteratively: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            return True
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v if isinstance(x, (dict, list)))
    return False


def _max_tokens(body: dict[str, Any]) -> int | None:
    return body.get("max_completion_tokens") or body.get("max_tokens")
