"""ASGI middleware at the edge: API-key check and request-body size limit, before any parsing."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.server.errors import APIError

OPEN_PATHS = frozenset({"/health"})


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
                await _reply(
                    scope,
                    receive,
                    send,
                    APIError(
                        "Incorrect API key provided."
                        if key
                        else "Missing API key: send 'Authorization: Bearer <key>'.",
                        401,
                        code="invalid_api_key",
                    ),
                )
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _reply(scope, receive, send, self._too_large())
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        # Read the whole body up front (the handlers need all of it anyway) so an oversized
        # chunked upload is refused before any parsing, then replay it to the app.
        parts: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await _reply(scope, receive, send, self._too_large())
                return
            parts.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> APIError:
        return APIError(
            f"request body is larger than the limit of {self.max_body_bytes} bytes",
            413,
            code="request_too_large",
        )


async def _reply(scope: Scope, receive: Receive, send: Send, err: APIError) -> None:
    response: Any = err.response()
    await response(scope, receive, send)
