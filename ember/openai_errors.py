"""What the engine's server and the router share about errors: the OpenAI error object's `type` for
an HTTP status (so a client sees the same error from either), and the header that marks an error as
the request's own fault."""

from __future__ import annotations

FAULT_HEADER = "x-ember-fault"
"""Set to "request" on an engine's answer that failed because of the request itself: the router
passes it on and never retries it on another engine (which would fail it the same way)."""


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"
