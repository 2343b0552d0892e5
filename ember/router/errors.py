"""The router's errors, shaped as OpenAI's (and ember serve's): `{"error": {"message", "type",
"param", "code"}}`, `code` a string or null, never a traceback."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ember.openai_errors import FAULT_HEADER, error_type

PASSED_HEADERS = ("retry-after", FAULT_HEADER)
"""Headers of an engine's error answer that reach the client."""


def error_body(
    message: str, status: int, type_: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type_ or error_type(status),
            "param": None,
            "code": code,
        }
    }


def error_response(
    message: str,
    status: int,
    *,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        body=orjson.dumps(error_body(message, status, code=code)),
        status=status,
        content_type="application/json",
        headers=headers,
    )


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, 413 body too large) and any unhandled exception become
    OpenAI-shaped answers; an exception is logged here, its text never reaches the client."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = e.reason if e.status != 413 else "the request body is too large"
        return error_response(message, e.status)
    except Exception:
        request.app.logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response("internal error in the router", 500)
