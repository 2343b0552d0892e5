"""`ember router`'s faces, a real router process over scripted engines: what it passes to engines
(the secret, the tenant; never a client's credentials or internal fields), which routes need the
cluster secret, OpenAI-shaped errors, and slow clients that must not take it down."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
from aiohttp import web

from ember.router.errors import openai_errors
from ember.trust import INTERNAL_HEADER, TENANT_HEADER, TenantKeys, internal_headers
from tests.router.conftest import Processes
from tests.servers import SECRET

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def assert_openai_error(r: httpx.Response, status: int, type_: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_ and err["message"]
    assert err["code"] is None or isinstance(err["code"], str)
    assert "Traceback" not in r.text
    return err


def test_engines_get_the_secret_and_tenant_never_client_credentials(procs: Processes) -> None:
    engine = procs.engine()
    router = procs.router(both=[engine], extra=["--api-key", "key-a", "key-b"])
    hostile = {
        **CHAT,
        "kv_transfer_params": {"do_remote_prefill": True, "release_url": "http://127.0.0.1:9/x"},
    }
    headers = {
        "authorization": "bearer key-b",  # lowercase scheme is accepted
        TENANT_HEADER: "someone-else",
        INTERNAL_HEADER: "a-guess",
        "x-session-id": "s1",
    }
    r = httpx.post(f"{router.url}/v1/chat/completions", json=hostile, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    call = engine.posts("/v1/chat/completions")[-1]
    got = {k.lower(): v for k, v in call.headers.items()}
    assert "kv_transfer_params" not in call.body
    assert "authorization" not in got
    keys = TenantKeys.load(["key-b"])
    assert got[TENANT_HEADER] == keys.namespace(keys.lookup("Bearer key-b"))
    assert got[INTERNAL_HEADER] == SECRET and got["x-session-id"] == "s1"
    # Polls, events and legs all carried the secret.
    assert engine.refused == 0 and len(engine.posts("/load")) > 0
    for auth in (None, "Bearer nope", "Basic key-a"):
        h = {"authorization": auth} if auth else {}
        r = httpx.post(f"{router.url}/v1/chat/completions", json=CHAT, headers=h, timeout=10)
        assert_openai_error(r, 401, "authentication_error")


def test_internal_routes_need_the_cluster_secret(procs: Processes) -> None:
    engine = procs.engine()
    router = procs.router(both=[engine])
    for path in ("/load", "/metrics"):
        assert_openai_error(httpx.get(router.url + path), 401, "authentication_error")
        assert httpx.get(router.url + path, headers=internal_headers(SECRET)).status_code == 200
    assert httpx.get(f"{router.url}/health").status_code == 200  # always open
    opened = procs.router(both=[engine], extra=["--public-metrics"])
    assert httpx.get(f"{opened.url}/metrics").status_code == 200
    assert httpx.get(f"{opened.url}/load").status_code == 401


def test_router_errors_are_openai_shaped(procs: Processes) -> None:
    engine = procs.engine()
    router = procs.router(both=[engine], extra=["--max-body-bytes", "4000"])
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    url = f"{router.url}/v1/chat/completions"
    assert_openai_error(httpx.post(url, json=big), 413, "invalid_request_error")

    def chunks():  # no content-length: the bound holds while reading too
        yield b'{"messages": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    assert_openai_error(httpx.post(url, content=chunks()), 413, "invalid_request_error")
    assert_openai_error(httpx.post(url, content=b"{nope"), 400, "invalid_request_error")
    assert_openai_error(httpx.post(url, json=[1, 2]), 400, "invalid_request_error")
    assert_openai_error(httpx.get(f"{router.url}/v1/nope"), 404, "not_found_error")
    assert_openai_error(httpx.get(url), 405, "invalid_request_error")
    assert len(engine.posts("/v1/chat/completions")) == 0


def test_an_unhandled_exception_is_an_openai_500_without_traceback() -> None:
    async def boom(_: web.Request) -> web.Response:
        raise RuntimeError("secret internals")

    async def main() -> httpx.Response:
        app = web.Application(middlewares=[openai_errors])
        app.router.add_get("/boom", boom)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with httpx.AsyncClient() as c:
                return await c.get(f"http://127.0.0.1:{port}/boom")
        finally:
            await runner.cleanup()

    r = asyncio.run(main())
    assert_openai_error(r, 500, "server_error")
    assert "secret internals" not in r.text and "RuntimeError" not in r.text


def test_slow_clients_neither_block_health_nor_hold_connections(procs: Processes) -> None:
    engine = procs.engine()
    router = procs.router(
        both=[engine], extra=["--header-timeout", "2", "--max-connections", "260"]
    )
    host, port = router.url.removeprefix("http://").split(":")
    slow = []
    for _ in range(200):  # slowloris: a request head that never ends
        s = socket.create_connection((host, int(port)))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        slow.append(s)
    try:
        t0 = time.monotonic()
        for _ in range(5):
            r = httpx.get(f"{router.url}/health", timeout=2)
            assert r.status_code == 200
        assert time.monotonic() - t0 < 5
        for s in slow:
            s.sendall(b"X-Drip: 1\r\n")  # still sending: the deadline is for the whole head
        time.sleep(2.5)
        for s in slow:  # the router closed each one at its head deadline
            assert _closed(s)
        # Over the cap, a new connection is closed as it arrives.
        extra = [socket.create_connection((host, int(port))) for _ in range(300)]
        try:
            closed = sum(_closed(s, 0.5) for s in extra)
            assert closed >= 300 - 260, closed
        finally:
            for s in extra:
                s.close()
        time.sleep(0.3)
        assert httpx.get(f"{router.url}/health", timeout=2).status_code == 200
    finally:
        for s in slow:
            s.close()


def _closed(s: socket.socket, timeout_s: float = 2.0) -> bool:
    """Whether the peer closed `s` within the timeout (whatever it sent before)."""
    s.settimeout(timeout_s)
    try:
        while s.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True
