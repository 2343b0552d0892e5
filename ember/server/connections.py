"""Connection limits uvicorn lacks: a deadline for a request's headers (slowloris), caps on open
connections in all and per client address, bounds on a request head's bytes and header count,
OpenAI-shaped answers to heads the parser refuses, and the process's file-descriptor limit raised
to its hard limit."""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
from collections import Counter
from http import HTTPStatus

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ember.edge_limits import (
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADERS,
)
from ember.openai_errors import error_type

log = logging.getLogger("ember.server")


def error_answer(status: int, message: str, code: str, headers: str = "") -> bytes:
    """A whole HTTP/1.1 answer with an OpenAI error body, closing the connection (`headers`:
    more header lines, each ending in CRLF)."""
    body = orjson.dumps(
        {"error": {"message": message, "type": error_type(status), "param": None, "code": code}}
    )
    return (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"{headers}connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


OVER_CAPACITY = error_answer(
    503,
    "the server has too many open connections; retry later",
    "too_many_connections",
    "retry-after: 1\r\n",
)


class _HeadTooLarge(Exception):
    """Raised inside the parser's callbacks: httptools stops and uvicorn calls send_400_response."""


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus: a connection that has not sent a request's complete
    headers within `header_timeout_s` of opening (or of starting its next request) is closed;
    past `max_connections` open ones, or `max_per_client` of one client address, a new
    connection gets a 503 and is closed at once; a head over `max_header_bytes` or with more
    than `max_headers` header lines gets a 431 (httptools itself has no limit: a 64 MB head was
    buffered whole, and stalled every stream while it was parsed)."""

    header_timeout_s: float = 10.0
    max_connections: int = 4096
    max_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    by_client: Counter[str]
    """Open connections by client address, shared by all connections of one server."""
    _header_timer: asyncio.TimerHandle | None = None
    _counted: str = ""
    _head_open: bool = True
    """The bytes arriving now belong to a request head (none has started, or its headers are
    still coming)."""
    _head_bytes: int = 0
    _head_lines: int = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        client = self.client[0] if self.client else "?"
        if (
            len(self.connections) > self.max_connections
            or self.by_client[client] >= self.max_per_client
        ):
            transport.write(OVER_CAPACITY)
            transport.close()
            return
        self._counted = client
        self.by_client[client] += 1
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._head_open:
            self._head_bytes += len(data)
        super().data_received(data)
        # One header line that never ends reaches no callback: count the bytes themselves.
        if self._head_open and self._head_bytes > self.max_header_bytes:
            self._refuse_head(f"the request head is over {self.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open = True
        self._head_lines = 0
        self._arm_header_timer()  # the next request of a keep-alive connection: same deadline

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.max_header_bytes:
            raise _HeadTooLarge(f"the request line is over {self.max_header_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_lines += 1
        if self._head_lines > self.max_headers:
            raise _HeadTooLarge(f"the request has more than {self.max_headers} header lines")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        self._head_open = False
        size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
        if size > self.max_header_bytes:
            raise _HeadTooLarge(f"the request head is over {self.max_header_bytes} bytes")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_open, self._head_bytes = True, 0

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to anything its parser refuses: an OpenAI error object instead of
        plain text, and a 431 for a head over the limits."""
        # Called inside uvicorn's `except HttpParserError`: the callback's own exception is the
        # context httptools gave it.
        exc = sys.exc_info()[1]
        cause = exc.__context__ if exc is not None else None
        if isinstance(cause, _HeadTooLarge):
            self._refuse_head(str(cause))
            return
        if not self.transport.is_closing():
            self.transport.write(error_answer(400, msg, "invalid_request"))
            self.transport.close()

    def _refuse_head(self, why: str) -> None:
        self._head_open = False
        if not self.transport.is_closing():
            log.debug("refused a request head from %s: %s", self.client, why)
            self.transport.write(error_answer(431, why, "header_too_large"))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self._counted:
            self.by_client[self._counted] -= 1
            if self.by_client[self._counted] <= 0:
                del self.by_client[self._counted]
            self._counted = ""
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(
    header_timeout_s: float,
    max_connections: int,
    max_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_headers: int = DEFAULT_MAX_HEADERS,
) -> type[GuardedHttpProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`, with these limits."""
    return type(
        "GuardedHttpProtocol",
        (GuardedHttpProtocol,),
        {
            "header_timeout_s": header_timeout_s,
            "max_connections": max_connections,
            "max_per_client": max_per_client,
            "max_header_bytes": max_header_bytes,
            "max_headers": max_headers,
            "by_client": Counter(),
        },
    )


def raise_fd_limit(reserve: int = 64) -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit; returns how many connections fit under
    it (minus `reserve` descriptors for the engine core's sockets, files and logs)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
    usable = soft if soft != resource.RLIM_INFINITY else 1 << 20
    return max(usable - reserve, 1)
