"""The router's connections: aiohttp's request handler with OpenAI-shaped answers to requests its
parser refuses (a bad header byte, an oversized head), a cap on open connections, and a cap on
those of one client address, so that one client cannot take every connection."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from ember.router.errors import error_body

log = logging.getLogger("ember.router")


@dataclass(slots=True)
class ConnectionCaps:
    """Open connections, in all and by client address (IP, any port)."""

    total: int
    per_client: int
    by_client: Counter[str] = field(default_factory=Counter)

    def admit(self, open_now: int, client: str) -> bool:
        return open_now < self.total and self.by_client[client] < self.per_client


def client_address(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


class EdgeHandler(RequestHandler):
    """aiohttp's handler, plus: parser errors (invalid header bytes, a line or a head over the
    limits) answer an OpenAI error object, logged at debug (a client's fault, not the router's);
    and a connection beyond the caps is closed as soon as it is made."""

    caps: ConnectionCaps
    server: web.Server
    client: str = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client = client_address(transport)
        if not self.caps.admit(len(self.server.connections), self.client):
            self.client = ""
            transport.close()
            return
        self.caps.by_client[self.client] += 1
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.client:
            self.caps.by_client[self.client] -= 1
            if self.caps.by_client[self.client] <= 0:
                del self.caps.by_client[self.client]
            self.client = ""
            super().connection_lost(exc)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        log.debug("refused a malformed request from %s: %s", request.remote, message)
        text = " ".join((message or "bad request").split())[:200]
        code = "invalid_request" if status == 400 else None
        resp = web.Response(
            body=orjson.dumps(error_body(f"malformed request: {text}", status, code=code)),
            status=status,
            content_type="application/json",
        )
        resp.force_close()
        return resp


def handler_factory(server: web.Server, caps: ConnectionCaps) -> Any:
    """A protocol factory for `loop.create_server`: `server`'s handlers, as EdgeHandlers."""
    kind = type("EdgeHandler", (EdgeHandler,), {"caps": caps, "server": server})

    def make() -> EdgeHandler:
        return kind(server, loop=asyncio.get_running_loop(), **server._kwargs)  # noqa: SLF001

    return make
