"""One request through the router: pick endpoints, run the prefill leg and then the decode leg (or
one colocated leg), relay the stream, rewrite the usage, and end cleanly whatever fails.

- A leg that fails before its first byte (connection refused, 5xx) is retried on another endpoint.
- After the first byte a failure ends the stream with an OpenAI-style error event and `[DONE]`.
- A client that hangs up cancels the handler: open legs are closed (each engine aborts the request
  and frees its blocks) and a prefill lease no decode leg has taken is released.
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

from ember.router.endpoint import Endpoint, NoEndpointError
from ember.router.metrics import RouterMetrics
from ember.router.pool import Choice, EndpointPool
from ember.router.prompt import PromptInfo, PromptReader

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
FORWARDED_HEADERS = ("authorization", "x-session-affinity", "x-session-id", "x-request-id")


class LegError(Exception):
    """An endpoint failed before it sent anything: the leg may be retried elsewhere."""


class Refused(Exception):
    """The engine turned the request down (4xx): the client gets that answer as it is."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def error_body(message: str, status: int, type_: str = "server_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": status}}


def error_response(message: str, status: int) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(error_body(message, status, kind), status=status)


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Router:
    def __init__(
        self,
        pool: EndpointPool,
        prompts: PromptReader,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        disagg_min_uncached: int = 256,
        max_attempts: int = 3,
    ) -> None:
        self.pool = pool
        self.prompts = prompts
        self.metrics = metrics
        self.session = session
        self.disagg_min_uncached = disagg_min_uncached
        self.max_attempts = max_attempts

    # -- entry -------------------------------------------------------------------------------

    async def handle(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json(loads=orjson.loads)
        except (ValueError, orjson.JSONDecodeError):
            return error_response("the request body is not valid JSON", 400)
        if not isinstance(body, dict):
            return error_response("the request body must be a JSON object", 400)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        session = request.headers.get("x-session-affinity") or request.headers.get("x-session-id")
        prompt = self.prompts.read(body, chat)
        self.metrics.prompt_tokens.inc(prompt.num_tokens)
        p = self._prefill_choice(body, prompt, session)
        if p is None:
            return await self._colocated(request, path, body, prompt, session, headers)
        return await self._disaggregated(request, path, body, prompt, session, headers, p)

    def _prefill_choice(
        self, body: dict[str, Any], prompt: PromptInfo, session: str | None
    ) -> Choice | None:
        """The prefill endpoint when the request should be split; None to run it in one place."""
        if not self.pool.has_role("prefill") or body.get("n", 1) != 1:
            return None
        if body.get("logprobs"):
            return None  # the decode leg has no logprob for the prefill's first token
        prompt_field = body.get("prompt")
        if isinstance(prompt_field, list) and prompt_field and isinstance(prompt_field[0], list):
            return None  # a batch of prompts
        try:
            p = self.pool.choose("prefill", prompt, session)
        except NoEndpointError:
            return None  # decode-capable endpoints can still prefill locally
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
            upstream, choice = await self._send_leg("decode", path, body, prompt, session, headers)
        except (LegError, NoEndpointError) as e:
            self.metrics.failures.labels("before_first_byte").inc()
            return error_response(str(e), 503)
        self.metrics.decisions.labels("colocated", choice.reason).inc()
        self.metrics.cached_estimated.inc(choice.cached_tokens)
        return await self._relay(
            request, upstream, choice.endpoint, None, decode_tokens=prompt.num_tokens
        )

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
            presp = await self._prefill(path, prefill_body, prompt, session, headers, first)
        except Refused as e:
            return e.response
        except (LegError, NoEndpointError) as e:
            self.metrics.failures.labels("before_first_byte").inc()
            return error_response(f"prefill failed: {e}", 503)
        kvp = presp.get("kv_transfer_params")
        cached = _cached_tokens(presp)
        self.metrics.decisions.labels("pd", first.reason).inc()
        self.metrics.cached_estimated.inc(first.cached_tokens)
        if kvp is None or _max_tokens(body) == 1:
            # The first token ended it (EOS, a stop id, max_tokens=1): nothing left to decode.
            if kvp is not None:
                self._release_soon(kvp)
            return await self._answer_from_prefill(request, presp, body, cached)
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = {
            **kvp,
            "do_remote_prefill": True,
            "do_remote_decode": False,
        }
        lease_pending = True
        try:
            try:
                upstream, d = await self._send_leg(
                    "decode", path, decode_body, prompt, session, headers
                )
            except (LegError, NoEndpointError) as e:
                self.metrics.failures.labels("before_first_byte").inc()
                return error_response(f"decode failed: {e}", 503)
            # A decode engine that took the request releases the lease once it has read the
            # blocks; one that turned it down (4xx) never will.
            lease_pending = upstream.status != 200
            return await self._relay(
                request, upstream, d.endpoint, cached, decode_tokens=prompt.num_tokens
            )
        finally:
            if lease_pending:
                self._release_soon(kvp)

    async def _prefill(
        self,
        path: str,
        body: dict[str, Any],
        prompt: PromptInfo,
        session: str | None,
        headers: dict[str, str],
        first: Choice,
    ) -> dict[str, Any]:
        """The prefill leg's answer (retried on other prefill endpoints); Refused on a 4xx."""
        resp, _ = await self._send_leg("prefill", path, body, prompt, session, headers, first)
        try:
            data = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise LegError(f"the prefill answer broke off: {e}") from e
        finally:
            resp.release()
        if resp.status != 200:
            raise Refused(
                web.Response(body=data, status=resp.status, content_type="application/json")
            )
        return orjson.loads(data)

    # -- legs ----------------------------------------------------------------------------------

    def _post(self, ep: Endpoint, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        return self.session.post(
            ep.url + path,
            data=orjson.dumps(body),
            headers={**headers, "content-type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_read=600),
        )

    async def _send_leg(
        self,
        leg: str,
        path: str,
        body: dict[str, Any],
        prompt: PromptInfo,
        session: str | None,
        headers: dict[str, str],
        first: Choice | None = None,
    ) -> tuple[aiohttp.ClientResponse, Choice]:
        """Open a streamed or whole leg on `first` (or the pool's choice), retried elsewhere until
        an endpoint answers below 500."""
        tried: set[str] = set()
        last: Exception | None = None
        for attempt in range(self.max_attempts):
            if attempt:
                self.metrics.retries.labels(leg).inc()
            if attempt == 0 and first is not None:
                choice = first
            else:
                choice = self.pool.choose(leg, prompt, session, exclude=tried)
            ep = choice.endpoint
            tried.add(ep.url)
            # A prefill leg's uncached tokens count against its endpoint until its answer comes
            # (a whole answer: the headers arrive when the prefill is done).
            queued = choice.uncached_tokens if leg == "prefill" else 0
            ep.add_load(prefill_tokens=queued, requests=int(leg == "prefill"))
            try:
                resp = await self._post(ep, path, body, headers).__aenter__()
            except (TimeoutError, aiohttp.ClientError) as e:
                self.pool.breakers[ep.url].record_failure()
                log.warning("%s leg on %s failed: %s", leg, ep.url, e)
                last = e
                continue
            finally:
                ep.remove_load(prefill_tokens=queued, requests=int(leg == "prefill"))
            if resp.status >= 500:
                self.pool.breakers[ep.url].record_failure()
                last = LegError(f"{ep.url} answered {resp.status}")
                resp.release()
                continue
            self.pool.breakers[ep.url].record_success()
            return resp, choice
        raise LegError(str(last) if last else "no endpoint answered")

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        ep: Endpoint,
        cached: int | None,
        decode_tokens: int,
    ) -> web.StreamResponse:
        """Hand an engine's answer to the client, rewriting usage.cached_tokens to the prefill
        side's when `cached` is given; `decode_tokens` count against `ep` meanwhile."""
        ep.add_load(decode_tokens=decode_tokens, requests=1)
        try:
            if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                data = await upstream.read()
                if upstream.status == 200:
                    obj = orjson.loads(data)
                    if cached is not None:
                        _set_cached(obj, cached)
                        data = orjson.dumps(obj)
                    self.metrics.cached_reported.inc(_cached_tokens(obj) or 0)
                return web.Response(
                    body=data, status=upstream.status, content_type="application/json"
                )
            resp = web.StreamResponse(
                status=200,
                headers={"content-type": "text/event-stream", "cache-control": "no-cache"},
            )
            await resp.prepare(request)
            done = False
            try:
                async for line in upstream.content:
                    if line.startswith(b"data: [DONE]"):
                        done = True
                    elif line.startswith(b"data: {") and b'"usage":{' in line:
                        obj = orjson.loads(line[6:])
                        if cached is not None:
                            _set_cached(obj, cached)
                            line = b"data: " + orjson.dumps(obj) + b"\n"
                        self.metrics.cached_reported.inc(_cached_tokens(obj) or 0)
                    await resp.write(line)
            except (TimeoutError, aiohttp.ClientError) as e:
                log.warning("stream from %s broke: %s", ep.url, e)
            if not done:  # the engine went away mid-stream: say so, and end the stream properly
                self.metrics.failures.labels("mid_stream").inc()
                self.pool.breakers[ep.url].record_failure()
                msg = f"the engine at {ep.url} failed mid-stream"
                await resp.write(sse(error_body(msg, 502)))
                await resp.write(DONE)
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.disconnects.inc()
            raise
        finally:
            upstream.close()  # on a client hang-up this aborts the engine's request
            ep.remove_load(decode_tokens=decode_tokens, requests=1)

    async def _answer_from_prefill(
        self, request: web.Request, presp: dict[str, Any], body: dict[str, Any], cached: int | None
    ) -> web.StreamResponse:
        presp.pop("kv_transfer_params", None)
        if cached is not None:
            _set_cached(presp, cached)
        if not body.get("stream"):
            return web.json_response(presp, dumps=lambda o: orjson.dumps(o).decode())
        resp = web.StreamResponse(
            status=200, headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        await resp.prepare(request)
        for chunk in _as_chunks(
            presp, bool((body.get("stream_options") or {}).get("include_usage"))
        ):
            await resp.write(sse(chunk))
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    def _release_soon(self, kvp: dict[str, Any]) -> None:
        """Release a prefill lease in the background (also when the handler is being cancelled)."""
        url = kvp.get("release_url")
        if not url:
            return

        async def release() -> None:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with self.session.post(
                    url,
                    data=orjson.dumps({"lease_id": kvp.get("lease_id")}),
                    headers={"content-type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=5),
                ):
                    pass

        task = asyncio.get_running_loop().create_task(release())
        _background.add(task)
        task.add_done_callback(_background.discard)


_background: set[asyncio.Task[None]] = set()


def _max_tokens(body: dict[str, Any]) -> int | None:
    return body.get("max_completion_tokens") or body.get("max_tokens")


def _cached_tokens(obj: dict[str, Any]) -> int | None:
    usage = obj.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


def _set_cached(obj: dict[str, Any], cached: int) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        usage["prompt_tokens_details"] = {
            **(usage.get("prompt_tokens_details") or {}),
            "cached_tokens": cached,
        }


def _as_chunks(full: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A whole answer as the stream chunks an engine would have sent."""
    base = {"id": full.get("id"), "created": full.get("created", int(time.time()))}
    base["model"] = full.get("model")
    chunks: list[dict[str, Any]] = []
    chat = full.get("object") == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"
    for c in full.get("choices", []):
        if chat:
            msg = c.get("message") or {}
            delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or ""}
            if msg.get("tool_calls"):
                delta["tool_calls"] = [{**tc, "index": i} for i, tc in enumerate(msg["tool_calls"])]
            chunks.append(
                {
                    **base,
                    "object": obj,
                    "choices": [
                        {
                            "index": c.get("index", 0),
                            "delta": delta,
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
            chunks.append(
                {
                    **base,
                    "object": obj,
                    "choices": [
                        {
                            "index": c.get("index", 0),
                            "delta": {},
                            "logprobs": None,
                            "finish_reason": c.get("finish_reason"),
                        }
                    ],
                }
            )
        else:
            chunks.append(
                {
                    **base,
                    "object": obj,
                    "choices": [
                        {
                            "index": c.get("index", 0),
                            "text": c.get("text", ""),
                            "logprobs": None,
                            "finish_reason": c.get("finish_reason"),
                        }
                    ],
                }
            )
    if include_usage:
        chunks.append({**base, "object": obj, "choices": [], "usage": full.get("usage")})
    return chunks
