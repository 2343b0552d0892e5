"""`ember serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of an engine-core
process. Routes: /v1/chat/completions, /v1/completions, /v1/models, vLLM's /tokenize and
/detokenize, /health, /load, /metrics, and for disaggregation /kv/release (a decode engine frees a prefill lease) and /kv_events (the prefix
cache's block events, for a router's prefix index)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from ember.engine.async_llm import AsyncLLM
from ember.engine.core_client import CoreClient, RequestFailedError
from ember.engine.core_spawn import SpawnedCore
from ember.engine.startup_clock import process_age_s
from ember.models.resolve import served_name
from ember.server.args import Prepared, prepare_serve
from ember.server.connections import guarded_protocol, raise_fd_limit
from ember.server.errors import APIError, error_from_status, validation_error
from ember.server.kv_params import kv_peer_urls
from ember.server.metrics import ServerMetrics
from ember.server.middleware import EdgeMiddleware
from ember.server.protocol import ChatCompletionRequest, CompletionRequest, StrictJSONRoute
from ember.server.serving import ServingContext
from ember.server.serving_chat import ChatHandler
from ember.server.serving_completion import CompletionHandler
from ember.server.serving_tokenize import TokenizeHandler
from ember.trust import TenantKeys, new_secret

log = logging.getLogger("ember.server")

KV_EVENTS_PAGE = 4096
"""Events per /kv_events answer unless `limit` says otherwise (at most KV_EVENTS_PAGE_MAX)."""
KV_EVENTS_PAGE_MAX = 65536


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str],
    *,
    keys: TenantKeys | None = None,
    secret: str | None = None,
    public_metrics: bool = False,
    kv_peers: list[str] | None = None,
    max_body_bytes: int = 32 << 20,
    max_waiting: int = 1024,
    tool_call_parser: str | None = "hermes",
    require_secret: bool = False,
) -> FastAPI:
    """`keys`: the public face's API keys (none: open); `secret`: the cluster secret of the
    internal face (None: a random one, so only this process knows it)."""
    secret = secret or new_secret()
    metrics = ServerMetrics(served_model_names[0], lambda: engine.stats)
    ctx = ServingContext(
        engine, metrics, served_model_names, max_waiting, secret, kv_peer_urls(kv_peers)
    )
    chat = ChatHandler(ctx, tool_call_parser)
    completions = CompletionHandler(ctx)
    tokens = TokenizeHandler(ctx)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202 - FastAPI's lifespan protocol
        # Start the engine in the background so /health can answer 503 while the model loads.
        app.state.engine_start = asyncio.create_task(_start(app, engine))
        yield
        app.state.draining = True
        app.state.engine_start.cancel()
        await engine.shutdown()

    app = FastAPI(title="ember", version="0.1.0", lifespan=lifespan)
    app.router.route_class = StrictJSONRoute
    app.state.draining = False
    app.state.start_error = None
    app.add_middleware(
        EdgeMiddleware,
        secret=secret,
        keys=keys,
        public_metrics=public_metrics,
        max_body_bytes=max_body_bytes,
        require_secret=require_secret,
    )

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> Response:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> Response:
        return validation_error(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> Response:
        message = e.detail if isinstance(e.detail, str) else None
        if e.status_code == 404:
            message = "Not found: no such route"
        err = error_from_status(e.status_code, message)
        err.headers = dict(e.headers or {})  # a 405's Allow
        return err.response()

    @app.exception_handler(RequestFailedError)
    async def _request_failed(_: Request, e: RequestFailedError) -> Response:
        # The core raised on this request alone: a 500 that no other engine should be tried with.
        return APIError(str(e), 500, request_fault=True).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> Response:
        log.exception("unhandled error")
        return APIError(f"internal error: {type(e).__name__}", 500).response()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _refuse_if_draining(app)
        return await chat.create(body, request)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        _refuse_if_draining(app)
        return await completions.create(body, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await tokens.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await tokens.detokenize(request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "ember",
                "root": engine.config.model,
                "max_model_len": engine.max_model_len,
            }
            for name in listed_names(served_model_names, engine.config.model)
        ]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> Response:
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine.is_ready:
            status = "failed" if engine.dead or app.state.start_error else "loading"
            return JSONResponse({"status": status}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/load")
    async def load() -> dict[str, Any]:
        s, ready = engine.stats, engine.ready
        return {
            "ready": engine.is_ready,
            "running": s.num_running,
            "waiting": s.num_waiting,
            "in_flight": engine.num_unfinished,
            "prefill_tokens": s.num_prefill_tokens,
            "decode_tokens": s.num_decode_tokens,
            "kv_usage": s.kv_usage,
            "free_blocks": s.num_free_blocks,
            "total_blocks": s.num_blocks,
            "prefix_cache_queries": s.prefix_queries,
            "prefix_cache_hits": s.prefix_hits,
            "role": engine.config.kv_role,
            "engine_id": ready.engine_id if ready else "",
            "block_size": engine.config.block_size,
            # A router refuses, before tokenizing it, a prompt longer than this (as we do).
            "max_model_len": engine.max_model_len,
            "max_prompt_chars": engine.inputs.max_prompt_chars,
            "kv_root_hash": ready.kv_root_hash.hex() if ready else "",
            "kv_event_seq": engine.kv_event_seq,
            "leases": s.num_leases,
            "lease_expiries": s.lease_expiries,
            "remote_kv_loads": s.remote_kv_loads,
            "remote_kv_failures": s.remote_kv_failures,
            "remote_kv_bytes": s.remote_kv_bytes,
            "remote_kv_seconds": s.remote_kv_seconds,
            # The shared KV store this engine writes its blocks to and loads from: a router
            # credits every engine on it for the blocks any of them computed.
            "kv_store": engine.config.kv_store,
            "kv_tiers": {
                medium: {
                    "blocks": t.occupancy_blocks,
                    "bytes": t.occupancy_bytes,
                    "capacity_bytes": t.capacity_bytes,
                }
                for medium, t in s.kv_tiers.items()
            },
        }

    @app.post("/kv/release")
    async def release(request: Request) -> dict[str, Any]:
        try:
            lease_id = (await request.json())["lease_id"]
        except (ValueError, KeyError, TypeError) as e:
            raise APIError('the body must be {"lease_id": "..."}', param="lease_id") from e
        if not isinstance(lease_id, str):
            raise APIError("lease_id must be a string", param="lease_id")
        try:
            released = await engine.release_lease(lease_id)
        except TimeoutError as e:  # the core is in a long step and the lease is not one we know
            raise APIError(
                "the engine did not answer in time; the lease's state is unknown",
                503,
                headers={"Retry-After": "1"},
            ) from e
        return {"lease_id": lease_id, "released": released}

    @app.get("/kv_events")
    async def kv_events(
        since: int = 0, limit: int = KV_EVENTS_PAGE, medium: str | None = None
    ) -> dict[str, Any]:
        # Paged: a whole backlog (200,000 events, 15 MB of JSON) froze every stream for seconds.
        # `seq` is the last event scanned (the next call's `since`); `more` says whether more
        # follow. Without `medium`: the GPU prefix cache's events as [kind, hash], as before the
        # tiers; with `medium=gpu,cpu,disk` (or "all"): those media's, as [kind, hash, medium].
        if not 1 <= limit <= KV_EVENTS_PAGE_MAX:
            raise APIError(f"limit must be in [1, {KV_EVENTS_PAGE_MAX}]", param="limit")
        media = _event_media(medium)
        newest, lost, events = engine.events_since(since)
        page, seq = [], newest
        for ev in events:
            if ev[3] in media:
                page.append(ev)
                if len(page) == limit:
                    seq = ev[0]
                    break
        labeled = medium is not None
        return {
            "seq": seq,
            "lost": lost,
            "more": seq < newest,
            "events": [[k, h, m] if labeled else [k, h] for _, k, h, m in page],
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


KV_MEDIA = ("gpu", "cpu", "disk", "store")


def _event_media(medium: str | None) -> frozenset[str]:
    """The media a /kv_events caller asks for: "gpu" unless it names some (or "all")."""
    if medium is None:
        return frozenset({"gpu"})
    if medium == "all":
        return frozenset(KV_MEDIA)
    asked = frozenset(medium.split(","))
    if not asked or not asked <= set(KV_MEDIA):
        raise APIError(
            f"medium must be a comma-separated list of {', '.join(KV_MEDIA)}, or all",
            param="medium",
        )
    return asked


def _refuse_if_draining(app: FastAPI) -> None:
    if app.state.draining:
        raise APIError("the server is shutting down", 503, headers={"Retry-After": "1"})


async def _start(app: FastAPI, engine: AsyncLLM) -> None:
    try:
        await engine.start()
        if (r := engine.ready) is not None:  # kv_root_hash in hex: raw bytes are noise in a log
            fields = {f: getattr(r, f) for f in r.__struct_fields__}
            log.info("engine ready: %s", fields | {"kv_root_hash": r.kv_root_hash.hex()})
        if (age := process_age_s()) is not None:
            log.info("serving %.1f s after the server process started", age)
    except Exception as e:
        app.state.start_error = str(e)
        log.error("engine failed to start: %s", e)
        server = getattr(app.state, "server", None)
        if server is not None:
            server.should_exit = True
        return
    # A dead core never comes back: exit (non-zero, see run_server) so that a supervisor restarts
    # this server, rather than answer 503 for good.
    await engine.died.wait()
    if not app.state.draining:
        app.state.engine_died = engine.dead or "engine core died"
        log.error("engine core died (%s); the server exits", engine.dead)
        server = getattr(app.state, "server", None)
        if server is not None:
            server.should_exit = True


class _Server(uvicorn.Server):
    """uvicorn, plus: /health turns 503 as soon as a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.app.state.draining = True
        super().handle_exit(sig, frame)


def listed_names(served: list[str], model_dir: str) -> list[str]:
    """The ids /v1/models lists: each served name once, in order, but not the model's directory
    when another name comes first (`ember up` serves its model under a name and accepts the path
    as well, for clients that send it: listed, it showed the model twice). `root` carries the
    path."""
    names = list(dict.fromkeys(served))
    return [n for i, n in enumerate(names) if i == 0 or n != model_dir]


def run_server(
    args: argparse.Namespace,
    prepared: Prepared | None = None,
    spawned: SpawnedCore | None = None,
) -> int:
    """Serve until shut down. `prepared` and `spawned`: what `ember serve` settled and the core
    it spawned with `prepared.config` before this module was imported
    (ember/engine/core_spawn.py); else both here."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        prepared = prepared or prepare_serve(args)
        given, secret, config = prepared.given, prepared.secret, prepared.config
        if not prepared.configured and args.role != "both":
            log.warning(
                "no cluster secret (--cluster-secret or EMBER_CLUSTER_SECRET): the router and "
                "the other engines cannot reach this engine's internal routes, nor trust its KV"
            )
        try:
            keys = TenantKeys.load(args.api_key or (), args.api_keys_file, args.shared_cache)
            kv_peer_urls(args.kv_peers)
        except ValueError as e:
            log.error("%s", e)
            return 2
        # The core first (unless it was started already): it imports, loads and compiles while
        # this process reads the tokenizer and starts the HTTP side.
        client = CoreClient(config, spawned)
        spawned = None  # the client owns it now
    finally:
        if spawned is not None:
            spawned.kill()
    try:
        engine = AsyncLLM(config, client)
    except BaseException:
        client.kill()
        raise
    parser = None if args.tool_call_parser in (None, "", "none") else args.tool_call_parser
    app = build_app(
        engine,
        args.served_model_name or [served_name(given)],
        keys=keys,
        secret=secret,
        public_metrics=args.public_metrics,
        kv_peers=args.kv_peers,
        max_body_bytes=args.max_body_bytes,
        max_waiting=args.max_waiting,
        tool_call_parser=parser,
        require_secret=args.require_secret,
    )
    # Slowloris: headers must arrive within --header-timeout; connections beyond
    # --max-connections (and beyond what the open-file limit allows) get a 503 at once.
    max_connections = min(args.max_connections, raise_fd_limit())
    uv = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        loop="uvloop",
        http=guarded_protocol(
            args.header_timeout,
            max_connections,
            # An engine behind a router has one client, the router: no cap of its own there.
            max_connections if args.require_secret else args.max_connections_per_client,
            args.max_header_bytes,
            args.max_headers,
        ),
        timeout_keep_alive=args.keep_alive_timeout,
        backlog=min(2048, max_connections),
        timeout_graceful_shutdown=args.drain_timeout,
        access_log=False,
    )
    server = _Server(uv, app)
    app.state.server = server
    # `ember serve` unwinds on a SIGTERM while it starts (cli._exit_on_sigterm); from here uvicorn
    # drains on it and then raises it again under the handler it found, so that is the default:
    # the process dies by the signal, as a supervisor expects of a clean stop, not exit 143.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    server.run()
    return 1 if app.state.start_error or getattr(app.state, "engine_died", None) else 0
