"""Connection limits uvicorn lacks: a deadline for a request's headers (slowloris), a cap on open
connections, and the process's file-descriptor limit raised to its hard limit."""

from __future__ import annotations

import asyncio
import logging
import resource

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("ember.server")

_BUSY = orjson.dumps(
    {
        "error": {
            "message": "the server has too many open connections; retry later",
            "type": "server_error",
            "param": None,
            "code": "too_many_connections",
        }
    }
)
OVER_CAPACITY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
    + str(len(_BUSY)).encode()
    + b"\r\n\r\n"
    + _BUSY
)


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus: a connection that has not sent a request's complete
    headers within `header_timeout_s` of opening (or of starting its next request) is closed, and
    past `max_connections` open ones a new connection gets a 503 and is closed at once."""

    header_timeout_s: float = 10.0
    max_connections: int = 4096
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(OVER_CAPACITY)
            transport.close()
            return
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()  # the next request of a keep-alive connection: same deadline

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
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


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[GuardedHttpProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`, with these limits."""
    return type(
        "GuardedHttpProtocol",
        (GuardedHttpProtocol,),
        {"header_timeout_s": header_timeout_s, "max_connections": max_connections},
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
