"""A scripted engine for router tests: a real HTTP server (aiohttp, on a thread of the test
process) that answers /load, /kv_events, /kv/release and the /v1 routes as `ember serve` does, or
as a test tells it to (fail, stall, close the connection), and records every call it gets."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from ember.trust import INTERNAL_HEADER
from tests.servers import SECRET

Reply = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


@dataclass
class Call:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeEngine:
    role: str = "both"
    reply: Reply | None = None
    """How /v1/* POSTs are answered; None: a normal whole or streamed completion."""
    events: list[list[str]] = field(default_factory=list)
    """KV events (["stored", hex hash], or with a medium: ["stored", hex hash, "cpu"]) served by
    /kv_events, `page` at a time with "more"."""
    page: int = 1000
    calls: list[Call] = field(default_factory=list)
    refused: int = 0
    """Calls without the cluster secret (answered 401)."""
    drop_loads: bool = False
    """While set, /load calls get no answer: their connection is closed (a lost reply)."""
    kv_store: str | None = None
    """The shared KV store its /load names (`--kv-store`), if any."""
    engine_id: str = "fake"

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sock,), daemon=True)
        self._thread.start()
        self._ready.wait(10)

    # -- what tests use ------------------------------------------------------------------------

    def load(self) -> dict[str, Any]:
        return {"kv_event_seq": len(self.events)}

    def posts(self, path: str) -> list[Call]:
        return [c for c in self.calls if c.path == path]

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def kill(self) -> None:
        """As an engine whose process died: its connections close, its port refuses new ones."""
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)

    # -- the server ----------------------------------------------------------------------------

    def _run(self, sock: socket.socket) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(middlewares=[self._record], client_max_size=64 << 20)
        app.router.add_get("/load", self._load)
        app.router.add_get("/kv_events", self._events)
        app.router.add_post("/kv/release", self._release)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.SockSite(runner, sock).start())
        self._ready.set()
        self._loop.run_forever()

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = orjson.loads(await request.read()) if request.can_read_body else None
        self.calls.append(Call(request.path, dict(request.headers), body))
        if request.headers.get(INTERNAL_HEADER) != SECRET:
            self.refused += 1
            return web.json_response({"error": {"message": "secret"}}, status=401)
        return await handler(request)

    async def _load(self, request: web.Request) -> web.Response:
        if self.drop_loads:
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return web.json_response(
            {
                "ready": True,
                "running": 0,
                "waiting": 0,
                "prefill_tokens": 0,
                "decode_tokens": 0,
                "kv_usage": 0.0,
                "engine_id": self.engine_id,
                "block_size": 16,
                "kv_root_hash": "ab" * 32,
                "kv_event_seq": len(self.events),
                "kv_store": self.kv_store,
            }
        )

    async def _events(self, request: web.Request) -> web.Response:
        since = int(request.query.get("since", 0))
        end = min(since + self.page, len(self.events))
        return web.json_response(
            {
                "seq": end,
                "lost": False,
                "events": self.events[since:end],
                "more": end < len(self.events),
            }
        )

    async def _release(self, request: web.Request) -> web.Response:
        return web.json_response({"released": True})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = self.calls[-1].body
        if self.reply is not None:
            return await self.reply(request, body)
        return await completion(request, body)


async def completion(
    request: web.Request, body: dict[str, Any], chunks: int = 3
) -> web.StreamResponse:
    """A normal answer: whole, or `chunks` SSE chunks, [DONE] and the blank line."""
    usage = {"prompt_tokens": 5, "completion_tokens": chunks, "total_tokens": 5 + chunks}
    if not body.get("stream"):
        choice = {"index": 0, "message": {"role": "assistant", "content": "x" * chunks}}
        return web.json_response(
            {"id": "c", "object": "chat.completion", "choices": [choice], "usage": usage}
        )
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(chunks):
        chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"delta": {"x": 1}}]}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
