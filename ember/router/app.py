"""`ember router`: an aiohttp server in front of pools of prefill, decode and colocated engines.
Public routes: /v1/chat/completions, /v1/completions (routed), /v1/models, /tokenize and /detokenize
(forwarded to a healthy decode-capable engine; all need an API key when keys are configured),
/health (always open). Internal routes, for the cluster secret only: /load (the
router's view of each endpoint) and /metrics (open with --public-metrics)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import signal
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ember.edge_limits import DEFAULT_MAX_HEADER_BYTES
from ember.models.resolve import resolve_model
from ember.openai_errors import FAULT_HEADER
from ember.router.connections import ConnectionCaps, handler_factory
from ember.router.errors import error_response, openai_errors
from ember.router.metrics import RouterMetrics
from ember.router.pool import EndpointPool
from ember.router.prompt import PromptReader
from ember.router.proxy import Router
from ember.trust import (
    HeaderError,
    Tenant,
    TenantKeys,
    checked_headers,
    internal_headers,
    is_internal,
    resolve_secret,
)

log = logging.getLogger("ember.router")

POOL = web.AppKey("pool", EndpointPool)
ROUTER = web.AppKey("router", Router)
TENANT = web.RequestKey("tenant", Tenant)
HEADERS = web.RequestKey("headers", dict)
"""The request's checked headers (`trust.checked_headers`): the only ones the router reads."""
INTERNAL_ROUTES = ("/load", "/metrics")
KEYED_ROUTES = ("/tokenize", "/detokenize")
"""Public routes outside /v1/ that still need an API key (vLLM serves them at the root)."""


def build_app(
    pool: EndpointPool,
    prompts: PromptReader,
    *,
    keys: TenantKeys | None = None,
    secret: str | None = None,
    public_metrics: bool = False,
    disagg_min_uncached: int = 256,
    stall_timeout_s: float = 30.0,
    max_body_bytes: int = 32 << 20,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> web.Application:
    metrics = RouterMetrics()
    keys = keys or TenantKeys()
    secret = secret or resolve_secret(None)[0]

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        path = request.path
        head = len(request.raw_path) + sum(len(k) + len(v) + 4 for k, v in request.raw_headers)
        if head > max_header_bytes:
            return error_response(
                f"the request head is over {max_header_bytes} bytes", 431, code="header_too_large"
            )
        try:
            headers = checked_headers(request.raw_headers)
        except HeaderError as e:
            return error_response(str(e), 400, code="invalid_header")
        request[HEADERS] = headers
        internal = is_internal(headers, secret)
        open_route = public_metrics and path == "/metrics"
        if path in INTERNAL_ROUTES and not internal and not open_route:
            return error_response("this route needs the cluster secret", 401)
        keyed = path.startswith("/v1/") or path in KEYED_ROUTES
        if keyed and keys.enabled and not internal:
            tenant = keys.lookup(headers.get("authorization"))
            if tenant is None:
                return error_response("invalid or missing API key", 401, code="invalid_api_key")
            request[TENANT] = tenant
        if (request.content_length or 0) > max_body_bytes:
            return error_response(f"the request body is over {max_body_bytes} bytes", 413)
        return await handler(request)

    app = web.Application(client_max_size=max_body_bytes, middlewares=[openai_errors, auth])
    app[POOL] = pool

    async def lifecycle(app: web.Application) -> Any:
        # Every call the router makes goes to an engine: the session carries the secret.
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers=internal_headers(secret)
        )
        app[ROUTER] = Router(
            pool,
            prompts,
            metrics,
            session,
            disagg_min_uncached,
            keys=keys,
            stall_timeout_s=stall_timeout_s,
        )
        poller = asyncio.create_task(pool.run(session), name="ember-router-poll")
        yield
        poller.cancel()
        await session.close()

    app.cleanup_ctx.append(lifecycle)

    async def chat(request: web.Request) -> web.StreamResponse:
        router = request.app[ROUTER]
        return await router.handle(
            request, "/v1/chat/completions", True, request.get(TENANT), request[HEADERS]
        )

    async def completions(request: web.Request) -> web.StreamResponse:
        router = request.app[ROUTER]
        return await router.handle(
            request, "/v1/completions", False, request.get(TENANT), request[HEADERS]
        )

    async def forward(request: web.Request) -> web.StreamResponse:
        """/v1/models, /tokenize, /detokenize: any healthy decode-capable engine answers (they
        share the model and its tokenizer); one that fails is skipped, its answer otherwise
        passed on as it is (a 4xx for a bad body or an unknown model included)."""
        router = request.app[ROUTER]
        body = await request.read() if request.method == "POST" else None
        headers = {"content-type": "application/json"} if body is not None else {}
        for ep in pool.candidates("decode"):
            try:
                async with router.session.request(
                    request.method,
                    ep.url + request.path,
                    data=body,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=30),
                ) as r:
                    if r.status >= 500 and r.headers.get(FAULT_HEADER) != "request":
                        continue
                    ctype = r.headers.get("content-type", "application/json").split(";")[0]
                    return web.Response(body=await r.read(), status=r.status, content_type=ctype)
            except (TimeoutError, aiohttp.ClientError):
                continue
        return error_response("no healthy endpoint", 503)

    async def health(_: web.Request) -> web.Response:
        up = {leg: bool(pool.candidates(leg)) for leg in ("prefill", "decode")}
        ok = up["decode"]  # decode-capable endpoints can always prefill locally
        return web.json_response(
            {"status": "ok" if ok else "unavailable", **up}, status=200 if ok else 503
        )

    async def load(_: web.Request) -> web.Response:
        now = time.monotonic()
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
                        # Blocks credited to it below the GPU: its own tiers', and its store's.
                        "tier_blocks": {m: i.num_blocks(e.url) for m, i in pool.tiers.items()},
                        "kv_store": pool.info[e.url].kv_store,
                        "store_blocks": pool.store.num_blocks(pool.info[e.url].kv_store, now),
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
    app.router.add_get("/v1/models", forward)
    app.router.add_post("/tokenize", forward)
    app.router.add_post("/detokenize", forward)
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
    secret, configured = resolve_secret(args.cluster_secret)
    if not configured:
        log.warning(
            "no --cluster-secret or $EMBER_CLUSTER_SECRET: engines that need one will refuse "
            "the router, and /load is closed"
        )
    keys = TenantKeys.load(args.api_key, args.api_keys_file, args.shared_cache)
    app = build_app(
        pool,
        PromptReader(resolve_model(args.model) if args.model else None),
        keys=keys,
        secret=secret,
        public_metrics=args.public_metrics,
        disagg_min_uncached=args.disagg_min_uncached,
        stall_timeout_s=args.stall_timeout,
        max_body_bytes=args.max_body_bytes,
        max_header_bytes=args.max_header_bytes,
    )
    log.info(
        "ember router on http://%s:%d, endpoints: %s", args.host, args.port, list(pool.endpoints)
    )
    asyncio.run(_serve(app, args))
    return 0


async def _serve(app: web.Application, args: argparse.Namespace) -> None:
    """aiohttp's run_app, plus what it lacks against slow or greedy clients: a deadline for a
    request's head (aiohttp's keep-alive timer runs from the connection's start until a whole
    head has arrived, and between requests), caps on open connections (below the fd limit) and
    on those of one client address, and bounds on a head's lines and header count (aiohttp's
    parser refuses longer ones before buffering more; the auth middleware checks the total)."""
    # A client that hangs up cancels its handler, which closes both legs (the engines abort).
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=args.header_timeout,
        shutdown_timeout=5,
        max_line_size=min(8190, args.max_header_bytes),
        max_field_size=min(8190, args.max_header_bytes),
        max_headers=args.max_headers,
    )
    await runner.setup()
    server = runner.server
    if server is None:
        raise RuntimeError("aiohttp runner has no server after setup")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = max(16, min(args.max_connections, soft // 2 if soft > 0 else args.max_connections))
    accept = handler_factory(server, ConnectionCaps(cap, args.max_connections_per_client))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    listener = await loop.create_server(accept, args.host, args.port, reuse_address=True)
    try:
        await stop.wait()
    finally:
        listener.close()
        await runner.cleanup()
