"""One request through a real `ember router` process over scripted engines: which answers are
retried and which are the client's, stalled streams, client hang-ups (not the engines' fault),
prefill fallbacks, KV leases released at the prefill endpoint the router chose, large bodies."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from ember.trust import internal_headers
from tests.router.conftest import Processes
from tests.router.fake_engine import completion, wait_until
from tests.servers import SECRET

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
LONG = {**CHAT, "messages": [{"role": "user", "content": "word " * 600}], "max_tokens": 50}
"""Over 256 tokens by the router's estimate (no --model): split into prefill and decode legs."""


def chat(url: str, body: dict[str, Any], timeout: float = 20) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)


def breakers(router_url: str) -> dict[str, str]:
    r = httpx.get(f"{router_url}/load", headers=internal_headers(SECRET), timeout=5)
    return {e["url"]: e["breaker"] for e in r.json()["endpoints"]}


def answer(status: int, headers: dict[str, str] | None = None) -> Any:
    async def reply(_: web.Request, __: dict[str, Any]) -> web.StreamResponse:
        err = {"error": {"message": "no", "type": "x", "param": None, "code": None}}
        return web.json_response(err, status=status, headers=headers)

    return reply


def test_only_engine_failures_are_retried_elsewhere(procs: Processes) -> None:
    a, b = procs.engine(), procs.engine()
    router = procs.router(both=[a, b])
    posts = lambda: len(a.posts("/v1/chat/completions")) + len(b.posts("/v1/chat/completions"))  # noqa: E731
    cases = [  # (engine's answer, the client's status, engines tried)
        (answer(400), 400, 1),
        (answer(500, {"x-ember-fault": "request"}), 500, 1),  # the request's own fault
        (answer(503), 503, 2),  # each engine's own failure: tried on both
        (answer(429, {"retry-after": "3"}), 429, 2),  # full queues: the last 429 is passed on
    ]
    for reply, status, tried in cases:
        a.reply = b.reply = reply
        before = posts()
        r = chat(router.url, CHAT)
        assert r.status_code == status, r.text
        assert posts() - before == tried, (status, posts() - before)
        assert "Traceback" not in r.text and isinstance(r.json()["error"], dict)
        if status == 429:
            assert r.headers["retry-after"] == "3"
        if tried == 1:
            assert r.headers.get("x-ember-fault") == ("request" if status == 500 else None)
    a.reply = b.reply = None
    assert chat(router.url, CHAT).status_code == 200


def test_a_stale_pooled_connection_is_retried_on_the_same_engine(procs: Processes) -> None:
    seen = []

    async def drop_first(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        seen.append(1)
        if len(seen) == 1:  # as an engine that closed a kept-alive connection: no byte back
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return await completion(request, body)

    engine = procs.engine(reply=drop_first)
    router = procs.router(both=[engine])
    r = chat(router.url, CHAT)
    assert r.status_code == 200, r.text
    assert len(seen) == 2
    assert set(breakers(router.url).values()) == {"closed"}


def test_a_stalled_stream_ends_with_an_error_event(procs: Processes) -> None:
    async def stall(request: web.Request, _: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": []}\n\n')
        await asyncio.sleep(60)  # as an engine stopped with SIGSTOP
        return resp

    engine = procs.engine(reply=stall)
    router = procs.router(both=[engine], extra=["--stall-timeout", "1"])
    t0 = time.monotonic()
    with httpx.stream(
        "POST", f"{router.url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert time.monotonic() - t0 < 10
    assert lines[-1] == "data: [DONE]"
    err = orjson.loads(lines[-2][6:])["error"]
    assert "sent nothing" in err["message"] and err["type"] == "server_error"


def test_client_hang_ups_leave_every_breaker_closed(procs: Processes) -> None:
    async def chatty(request: web.Request, _: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(400):
            await resp.write(b'data: {"choices": [], "pad": "' + b"p" * 2000 + b'"}\n\n')
            if i % 50 == 0:
                await asyncio.sleep(0)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    engines = [procs.engine(reply=chatty), procs.engine(reply=chatty)]
    router = procs.router(both=engines)
    rng = random.Random(0)

    async def one(client: httpx.AsyncClient) -> None:
        stop_after = rng.randrange(0, 30)
        body = {**CHAT, "stream": True}
        async with client.stream("POST", f"{router.url}/v1/chat/completions", json=body) as r:
            n = 0
            async for _ in r.aiter_bytes():
                n += 1
                if n > stop_after:
                    break  # hang up mid-stream

    async def main() -> None:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            await asyncio.gather(*(one(client) for _ in range(200)), return_exceptions=True)

    asyncio.run(main())
    assert set(breakers(router.url).values()) == {"closed"}
    for _ in range(6):
        with httpx.stream(
            "POST", f"{router.url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30
        ) as r:
            assert r.status_code == 200
            assert [ln for ln in r.iter_lines() if ln][-1] == "data: [DONE]"


def kv_reply(lease: str, decode: Any = None) -> Any:
    """A prefill engine's answer: a lease whose release_url points anywhere but at itself."""

    async def reply(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if isinstance(body.get("prompt"), list) and body.get("kv_transfer_params"):
            return await answer(400)(request, body)  # as ember serve: no batch with KV params
        params = {"lease_id": lease, "release_url": "http://127.0.0.1:9/kv/release"}
        choice = {"index": 0, "message": {"role": "assistant", "content": "x"}}
        return web.json_response(
            {"object": "chat.completion", "choices": [choice], "kv_transfer_params": params}
        )

    return reply


def releases(engine: Any) -> list[str]:
    return [c.body["lease_id"] for c in engine.posts("/kv/release")]


def test_leases_are_released_at_the_chosen_prefill_endpoint(procs: Processes) -> None:
    prefill, decode = procs.engine(role="prefill"), procs.engine(role="decode")
    router = procs.router(prefill=[prefill], decode=[decode])
    # The decode engine turns the leg down: the router releases the lease, at the prefill
    # endpoint it chose (never at the release_url of an answer).
    prefill.reply, decode.reply = kv_reply("L1"), answer(400)
    assert chat(router.url, LONG).status_code == 400
    assert wait_until(lambda: releases(prefill) == ["L1"]), releases(prefill)
    leg = decode.posts("/v1/chat/completions")[-1].body["kv_transfer_params"]
    assert leg["do_remote_prefill"] is True and leg["lease_id"] == "L1"

    # The decode leg runs to its end: the decode engine releases, not the router.
    prefill.reply, decode.reply = kv_reply("L2"), None
    assert chat(router.url, LONG).status_code == 200
    time.sleep(0.5)
    assert releases(prefill) == ["L1"]

    # The client hangs up while the decode leg waits (its engine's queue is long): the decode
    # engine will never read the blocks, so the router releases them now, not at expiry.
    async def queued(request: web.Request, _: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(30)
        return resp

    prefill.reply, decode.reply = kv_reply("L3"), queued
    with pytest.raises(httpx.ReadTimeout):
        chat(router.url, {**LONG, "stream": True}, timeout=1)
    assert wait_until(lambda: releases(prefill) == ["L1", "L3"], 5), releases(prefill)


def test_without_a_working_prefill_engine_decode_prefills_in_place(procs: Processes) -> None:
    prefill, decode = procs.engine(role="prefill", reply=answer(503)), procs.engine(role="decode")
    router = procs.router(prefill=[prefill], decode=[decode])
    r = chat(router.url, LONG)
    assert r.status_code == 200, r.text
    assert len(prefill.posts("/v1/chat/completions")) == 1
    whole = decode.posts("/v1/chat/completions")[-1].body
    assert "kv_transfer_params" not in whole


def test_batched_string_prompts_go_whole_to_one_engine(procs: Processes) -> None:
    prefill, decode = procs.engine(role="prefill"), procs.engine(role="decode")
    prefill.reply = kv_reply("unused")
    router = procs.router(prefill=[prefill], decode=[decode])
    body = {"model": "tiny", "prompt": ["y" * 1024, "hello"], "max_tokens": 3}
    r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert prefill.posts("/v1/completions") == []
    assert decode.posts("/v1/completions")[-1].body["prompt"] == body["prompt"]


def test_a_large_prompt_does_not_stall_the_router(procs: Processes, tiny_model_dir: Any) -> None:
    engine = procs.engine()
    model: Path = tiny_model_dir("llama")
    router = procs.router(both=[engine], model=model)
    words = " ".join(f"w{i % 5000}" for i in range(200_000))  # ~1.4 MB of text
    big = {**CHAT, "messages": [{"role": "user", "content": words}]}
    result: list[int] = []
    sender = threading.Thread(target=lambda: result.append(chat(router.url, big, 60).status_code))
    sender.start()
    worst = 0.0
    while sender.is_alive():
        t0 = time.monotonic()
        assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    sender.join()
    assert result == [200]
    assert worst < 0.5, worst
