"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

from http import HTTPStatus

import orjson
from starlette.responses import Response


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
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}

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
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
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
