"""The router passes a request's `speculative` field to the engines untouched, on one engine and
on both legs of a disaggregated request; judging its value is the engine's job (a 400 there)."""

from __future__ import annotations

from typing import Any

import httpx
from aiohttp import web

from tests.router.conftest import Processes

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
LONG = {**CHAT, "messages": [{"role": "user", "content": "word " * 600}]}
"""Over 256 tokens by the router's estimate (no --model): split into prefill and decode legs."""


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=20)


def test_one_engine_gets_the_field_as_sent(procs: Processes) -> None:
    engine = procs.engine()
    router = procs.router(both=[engine])
    sent = [
        (path, {**body, "speculative": value, "stream": stream})
        for value in (False, True, "no", 0, None)
        for stream in (False, True)
        for path, body in (
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3}),
        )
    ]
    for path, body in sent:
        r = post(router.url, path, body)
        assert r.status_code == 200, r.text
        got = engine.posts(path)[-1].body
        assert "speculative" in got and got["speculative"] == body["speculative"]
        assert type(got["speculative"]) is type(body["speculative"])  # 0 stays 0, not False


async def lease(_: web.Request, __: dict[str, Any]) -> web.StreamResponse:
    """A prefill engine's answer: the first token and where its KV waits."""
    params = {"lease_id": "L1", "release_url": "http://127.0.0.1:9/kv/release"}
    choice = {"index": 0, "message": {"role": "assistant", "content": "x"}}
    return web.json_response(
        {"object": "chat.completion", "choices": [choice], "kv_transfer_params": params}
    )


def test_both_legs_of_a_disaggregated_request_get_it(procs: Processes) -> None:
    prefill, decode = procs.engine(role="prefill", reply=lease), procs.engine(role="decode")
    router = procs.router(prefill=[prefill], decode=[decode])
    r = post(router.url, "/v1/chat/completions", {**LONG, "speculative": False})
    assert r.status_code == 200, r.text
    first = prefill.posts("/v1/chat/completions")[-1].body
    leg = decode.posts("/v1/chat/completions")[-1].body
    assert leg["kv_transfer_params"]["do_remote_prefill"] is True  # it was split
    assert first["speculative"] is False and leg["speculative"] is False
