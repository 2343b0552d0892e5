"""ASGI middleware at the edge: who is calling (a peer with the cluster secret, a tenant's API key,
or nobody), and the request-body size limit, before any parsing. An engine that requires the
secret (`--require-secret`, every engine `ember up` starts) answers nobody else but /health."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.server.errors import APIError
from ember.trust import (
    INTERNAL_HEADER,
    TENANT_HEADER,
    HeaderError,
    TenantKeys,
    checked_headers,
    is_internal,
)

OPEN_PATHS = frozenset({"/health"})
INTERNAL_PATHS = frozenset({"/load", "/kv_events", "/kv/release", "/metrics"})
"""The internal face: only ember's own processes (with the cluster secret) may call these."""
PUBLIC_PATHS = frozenset({"/tokenize", "/detokenize"})
"""Public routes outside /v1/ (vLLM's): like /v1/*, they need an API key when keys are set."""
CALLER_KEY = "ember.caller"
"""Where the middleware leaves the request's `Caller` in the ASGI scope for the handlers."""


@dataclass(frozen=True, slots=True)
class Caller:
    internal: bool
    """The request carries the cluster secret: internal fields (KV transfer, tenant) count."""
    namespace: str = ""
    """The tenant's prefix-cache namespace ("" for none)."""


PUBLIC_CALLER = Caller(internal=False)


def caller_of(scope: Scope) -> Caller:
    return scope.get(CALLER_KEY, PUBLIC_CALLER)


class EdgeMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        secret: str,
        keys: TenantKeys | None = None,
        public_metrics: bool = False,
        max_body_bytes: int = 32 << 20,
        require_secret: bool = False,
    ) -> None:
        self.app = app
        self.secret = secret
        self.keys = keys or TenantKeys()
        self.public_metrics = public_metrics
        self.max_body_bytes = max_body_bytes
        self.require_secret = require_secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        try:
            err = self._admit(scope, checked_headers(scope["headers"]))
        except HeaderError as e:
            err = APIError(str(e), 400, param=e.header, code="invalid_header")
        if err is not None:
            await _reply(scope, receive, send, err)
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

    def _admit(self, scope: Scope, headers: dict[str, str]) -> APIError | None:
        """Record the caller in the scope, or say why the request may not pass."""
        path = scope["path"]
        if path in OPEN_PATHS or (path == "/metrics" and self.public_metrics):
            return None
        given = headers.get(INTERNAL_HEADER, "")
        if is_internal(headers, self.secret):
            # A peer (the router) resolved the tenant already; only a peer is believed on it.
            scope[CALLER_KEY] = Caller(internal=True, namespace=headers.get(TENANT_HEADER, ""))
            return None
        if self.require_secret:
            return APIError(
                "this engine answers only the ember cluster it belongs to (send requests to its "
                f"router): it needs the cluster secret (header {INTERNAL_HEADER})."
                if not given
                else "Incorrect cluster secret.",
                401,
                code="invalid_cluster_secret",
            )
        if path in INTERNAL_PATHS:
            return APIError(
                f"{path} is internal to the ember cluster: it needs the cluster secret "
                f"(header {INTERNAL_HEADER})."
                if not given
                else "Incorrect cluster secret.",
                401,
                code="invalid_cluster_secret",
            )
        if not self.keys.enabled:
            scope[CALLER_KEY] = PUBLIC_CALLER
            return None
        auth = headers.get("authorization", "")
        tenant = self.keys.lookup(auth)
        if tenant is None:
            return APIError(
                "Incorrect API key provided."
                if auth
                else "Missing API key: send 'Authorization: Bearer <key>'.",
                401,
                code="invalid_api_key",
            )
        scope[CALLER_KEY] = Caller(internal=False, namespace=self.keys.namespace(tenant))
        return None

    def _too_large(self) -> APIError:
        return APIError(
            f"request body is larger than the limit of {self.max_body_bytes} bytes",
            413,
            code="request_too_large",
        )


async def _reply(scope: Scope, receive: Receive, send: Send, err: APIError) -> None:
    response: Any = err.response()
    await response(scope, receive, send)
