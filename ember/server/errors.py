"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson
from starlette.responses import Response

from ember.openai_errors import FAULT_HEADER, error_type


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
        self.type = type or error_type(status)
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


def error_from_status(status: int, message: str | None = None) -> APIError:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    return APIError(message or phrase, status)


def validation_error(errors: Any) -> APIError:
    """pydantic's 422 becomes OpenAI's 400, naming the first offending parameter (its path in the
    body, without pydantic's union-member tags such as `str` or `list[constrained-int]`)."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return APIError(f"the request body is not valid JSON: {why}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_union_tag(p)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")
    return APIError(f"{param}: {msg}" if param else msg, 400, param=param)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or not part.replace("_", "a").isalnum())
