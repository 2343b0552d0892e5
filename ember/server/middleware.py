"""ASGI middleware at the edge: API-key check and request-body size limit, before any parsing."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.server.errors import APIError

OPEN_PATHS = frozenset({"/health"})


class _BodyTooLarge(Exception):
    pass


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"")
            key = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(key, self.api_key):
                await _reply(scope, receive, send, APIError(
                    "Incorrect API key provided." if key else "Missing API key: send "
                    "'Authorization: Bearer <key>'.",
                    401, code="invalid_api_key",
                ))
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _reply(scope, receive, send, self._too_large())
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _reply(scope, receive, send, self._too_large())

    def _too_large(self) -> APIError:
        return APIError(
            f"request body is larger than the limit of {self.max_body_bytes} bytes", 413,
            code="request_too_large",
        )


async def _reply(scope: Scope, receive: Receive, send: Send, err: APIError) -> None:
    response: Any = err.response()
    await response(scope, receive, send)
