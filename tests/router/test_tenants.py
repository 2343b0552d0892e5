"""Tenant isolation through the whole cluster: a router with two API keys over a prefill and a
decode engine. Tenant B's guess of tenant A's prompt finds nothing cached anywhere (no engine counts
a prefix-cache hit for it, so it costs exactly a miss's work), while A's own repeat hits; the
internal routes that could list the cache are closed without the cluster secret."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.servers import Server, start_router, start_server, wait_router_caught_up

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")

KA, KB = "sk-tenant-a", "sk-tenant-b"
ENGINE = ("--cpu-threads", "1", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir) -> Iterator[tuple[Server, list[Server]]]:
    model = tiny_model_dir("llama")
    prefill = start_server(model, "--role", "prefill", *ENGINE)
    decode = start_server(model, "--role", "decode", "--kv-peers", prefill.url, *ENGINE)
    router = start_router(model, prefill=[prefill], decode=[decode], extra=["--api-key", KA, KB])
    yield router, [prefill, decode]
    for s in (router, decode, prefill):
        s.stop()


def chat(router: Server, key: str, text: str) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}
    r = httpx.post(
        f"{router.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def hits(engines: list[Server]) -> int:
    return sum(e.load()["prefix_cache_hits"] for e in engines)


def test_one_tenant_cannot_hit_anothers_cache(cluster) -> None:
    router, engines = cluster
    secret = "Tenant A's system prompt: the launch code is 4-8-15-16-23-42. " * 12
    assert cached(chat(router, KA, secret)) == 0
    wait_router_caught_up(router, engines)  # the router's prefix index has A's blocks
    assert cached(chat(router, KA, secret)) > 100  # A's own repeat: the prompt is cached
    wait_router_caught_up(router, engines)
    before = hits(engines)
    guess = chat(router, KB, secret)
    assert cached(guess) == 0
    # Not one block of B's request was found in any engine's cache: B paid a miss, to the token.
    assert hits(engines) == before
    # And B's own repeat hits B's own blocks.
    wait_router_caught_up(router, engines)
    assert cached(chat(router, KB, secret)) > 100


def test_the_cache_cannot_be_listed_without_the_secret(cluster) -> None:
    router, engines = cluster
    for e in engines:
        for path in ("/kv_events?since=0", "/load", "/metrics"):
            r = httpx.get(f"{e.url}{path}", timeout=5)
            assert r.status_code == 401, (e.url, path, r.text)
            # Nor with a tenant's own API key.
            r = httpx.get(f"{e.url}{path}", headers={"authorization": f"Bearer {KA}"}, timeout=5)
            assert r.status_code == 401
    for path in ("/load", "/metrics"):
        r = httpx.get(f"{router.url}{path}", headers={"authorization": f"Bearer {KA}"}, timeout=5)
        assert r.status_code == 401, (path, r.text)
    r = httpx.get(f"{router.url}/v1/models", headers={"authorization": "Bearer sk-nobody"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def raw_request(
    url: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b""
) -> tuple[int, dict]:
    """One HTTP/1.1 request written byte for byte (clients refuse to send what is tried here)."""
    import json
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(url)
    method = b"POST" if body else b"GET"
    head = b"%s %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" % (method, path.encode())
    head += b"".join(k + b": " + v + b"\r\n" for k, v in headers)
    if body:
        head += b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(head + b"\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(payload) if payload.startswith(b"{") else {}


BAD_HEADERS = [
    [(b"authorization", b"Bearer \xff\xfe")],
    [(b"x-ember-cluster-secret", b"\xc3\x28")],
    [(b"x-session-affinity", b"ses_\x80\x81")],
    [(b"x-session-affinity", b"ses\x01a")],
    [(b"authorization", b"Bearer " + KA.encode()), (b"Authorization", b"Bearer " + KB.encode())],
    [(b"x-ember-cluster-secret", b"a"), (b"x-ember-cluster-secret", b"b")],
    [(b"x-request-id", b"r" * 5000)],
]


@pytest.mark.parametrize("bad", BAD_HEADERS, ids=range(len(BAD_HEADERS)))
def test_undecodable_or_repeated_security_headers_are_400_on_both_faces(cluster, bad) -> None:
    """Before: the router answered 500 (a traceback in its log) to non-UTF-8 bytes in
    Authorization, the secret or the session header, on /health too; with two Authorization
    headers the engine took the last and the router the first."""
    router, (prefill, _) = cluster
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    for url, path, data in [
        (router.url, "/v1/chat/completions", body),
        (router.url, "/health", b""),
        (prefill.url, "/v1/chat/completions", body),
        (prefill.url, "/load", b""),
    ]:
        status, answer = raw_request(url, path, bad, data)
        assert status == 400, (url, path, answer)
        # Ours, or the HTTP parser's own refusal of a control byte (both faces' parsers refuse
        # it before the headers reach ember; both answer with an error object).
        assert answer["error"]["code"] in ("invalid_header", "invalid_request")
        assert set(answer["error"]) == {"message", "type", "param", "code"}
    # Either face still answers well-formed requests.
    assert chat(router, KA, "still fine")["choices"]


def test_a_prompt_that_cannot_fit_is_refused_by_the_router_before_tokenizing(cluster) -> None:
    """Before: the router tokenized a whole prompt before any length check (a 30 MB chat took it
    from 66 MB to 2.96 GB, and it kept that memory)."""
    import time
    from pathlib import Path

    router, _ = cluster

    def rss_mb() -> float:
        status = Path(f"/proc/{router.proc.pid}/status").read_text()
        return int(next(x.split()[1] for x in status.splitlines() if x.startswith("VmRSS"))) / 1024

    before = rss_mb()
    for chat_route, body in [
        (True, {"messages": [{"role": "user", "content": "word " * 2_000_000}], "max_tokens": 1}),
        (False, {"prompt": "word " * 2_000_000, "max_tokens": 1}),
    ]:
        t0 = time.monotonic()
        path = "/v1/chat/completions" if chat_route else "/v1/completions"
        r = httpx.post(
            f"{router.url}{path}",
            json=body,
            headers={"authorization": f"Bearer {KA}"},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert time.monotonic() - t0 < 3
    assert rss_mb() - before < 150
    assert chat(router, KA, "a short one")["choices"]
