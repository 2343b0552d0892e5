"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

from http import HTTPStatus

import orjson
from starlette.responses import Response

FAULT_HEADER = "x-ember-fault"
"""Set to "request" on an answer that failed because of the request itself: a router passes it on
and never retries it on another engine."""


class APIError(Exception):
    """An error the client should see, with its HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        request_fault: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}
        # A 4xx is the request's own fault, except 429: capacity, which another engine may have.
        self.request_fault = (
            400 <= status < 500 and status != 429 if request_fault is None else request_fault
        )

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        headers = dict(self.headers)
        if self.request_fault:
            headers[FAULT_HEADER] = "request"
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=headers,
        )


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_from_status(status: int, message: str | None = None) -> APIError:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    return APIError(message or phrase, status)
