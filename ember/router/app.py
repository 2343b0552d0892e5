"""`ember router`: an aiohttp server in front of pools of prefill, decode and colocated engines.
Routes: /v1/chat/completions, /v1/completions (routed), /v1/models, /health, /load (the router's
view of each endpoint), /metrics."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ember.router.metrics import RouterMetrics
from ember.router.pool import EndpointPool
from ember.router.prompt import PromptReader
from ember.router.proxy import Router, error_response

log = logging.getLogger("ember.router")

POOL = web.AppKey("pool", EndpointPool)
ROUTER = web.AppKey("router", Router)


def build_app(
    pool: EndpointPool,
    prompts: PromptReader,
    *,
    api_key: str | None = None,
    disagg_min_uncached: int = 256,
) -> web.Application:
    metrics = RouterMetrics()

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if api_key and request.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response("invalid or missing API key", 401)
        return await handler(request)

    app = web.Application(client_max_size=64 << 20, middlewares=[auth])
    app[POOL] = pool

    async def lifecycle(app: web.Application) -> Any:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        app[ROUTER] = Router(pool, prompts, metrics, session, disagg_min_uncached)
        poller = asyncio.create_task(pool.run(session), name="ember-router-poll")
        yield
        poller.cancel()
        await session.close()

    app.cleanup_ctx.append(lifecycle)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await request.app[ROUTER].handle(request, "/v1/chat/completions", chat=True)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await request.app[ROUTER].handle(request, "/v1/completions", chat=False)

    async def models(request: web.Request) -> web.StreamResponse:
        router = request.app[ROUTER]
        for ep in pool.endpoints.values():
            if not ep.healthy:
                continue
            try:
                async with router.session.get(f"{ep.url}/v1/models") as r:
                    return web.Response(
                        body=await r.read(), status=r.status, content_type="application/json"
                    )
            except aiohttp.ClientError:
                continue
        return error_response("no healthy endpoint", 503)

    async def health(_: web.Request) -> web.Response:
        up = {leg: bool(pool.candidates(leg)) for leg in ("prefill", "decode")}
        ok = up["decode"]  # decode-capable endpoints can always prefill locally
        return web.json_response(
            {"status": "ok" if ok else "unavailable", **up}, status=200 if ok else 503
        )

    async def load(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "endpoints": [
                    {
                        "url": e.url,
                        "role": e.role,
                        "healthy": e.healthy,
                        "breaker": str(pool.breakers[e.url].state),
                        "prefill_tokens": e.queued_prefill_tokens,
                        "decode_tokens": e.active_decode_tokens,
                        "active_requests": e.active_requests,
                        "kv_usage": e.kv_usage,
                        "cached_blocks": pool.prefix.num_blocks(e.url),
                        # The last KV event the prefix index applied (the engine's /load says
                        # how far the engine is): how stale the index is.
                        "kv_event_seq": pool.info[e.url].event_seq,
                    }
                    for e in pool.endpoints.values()
                ]
            }
        )

    async def prometheus(_: web.Request) -> web.Response:
        for e in pool.endpoints.values():
            cost = e.prefill_cost() + e.decode_cost()
            metrics.endpoint_load.labels(e.url, e.role).set(cost)
        return web.Response(
            body=generate_latest(metrics.registry), headers={"content-type": CONTENT_TYPE_LATEST}
        )

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", prometheus)
    return app


def run_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    pool = EndpointPool.build(
        args.prefill,
        args.decode,
        args.both,
        poll_s=args.poll_interval,
        epsilon=args.affinity_epsilon,
    )
    if not any(e.role != "prefill" for e in pool.endpoints.values()):
        raise ValueError("the router needs at least one --decode or --both endpoint")
    app = build_app(
        pool,
        PromptReader(args.model),
        api_key=args.api_key,
        disagg_min_uncached=args.disagg_min_uncached,
    )
    log.info(
        "ember router on http://%s:%d, endpoints: %s", args.host, args.port, list(pool.endpoints)
    )
    # A client that hangs up cancels its handler, which closes both legs (the engines abort).
    web.run_app(
        app, host=args.host, port=args.port, handler_cancellation=True, print=None, access_log=None
    )
    return 0
