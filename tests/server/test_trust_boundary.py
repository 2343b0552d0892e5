"""The engine's trust boundary through real `ember serve` processes: internal routes need the
cluster secret, a client's kv_transfer_params are ignored, a decode engine reads only KV a peer
signed (and, with --kv-peers, only from those peers), each API key's prefix cache is its own."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
import torch

from ember.server.api_server import build_app
from ember.server.args import add_serve_args, engine_config_from_args
from ember.server.middleware import INTERNAL_PATHS, OPEN_PATHS, PUBLIC_PATHS
from ember.trust import TENANT_HEADER, TenantKeys, internal_headers, sign_kv_params
from tests.server.conftest import Server
from tests.servers import SECRET, free_port

KA, KB = "key-of-tenant-a", "key-of-tenant-b"
INTERNAL = internal_headers(SECRET)
PROMPT = [(17 * i) % 2900 + 40 for i in range(40)]
"""A token-id prompt: its length (40) is known exactly, as a forged lease must name it."""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(s: Server, headers: dict[str, str], **body: object) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(f"{s.base}/completions", json=body, headers=headers, timeout=60)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    return err


def cached(r: httpx.Response) -> int:
    return ok(r)["usage"]["prompt_tokens_details"]["cached_tokens"]


class Listener:
    """A stand-in for an attacker's URL: records every call it gets."""

    def __init__(self) -> None:
        calls: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                calls.append(self.path)
                body = b'{"released": true}'
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.calls = calls
        self.port = free_port()
        self.http = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/kv/release"


@pytest.fixture
def listener() -> Iterator[Listener]:
    lis = Listener()
    yield lis
    lis.http.shutdown()


def forged(listener: Listener, first_token_id: int = 1, **kw: object) -> dict:
    """Made-up lease: block ids the client names, a release URL of its own."""
    return {
        "do_remote_prefill": True,
        "engine_id": "x",
        "lease_id": "x:1",
        "block_ids": [0, 1, 2],
        "transfer_address": "127.0.0.1:1",
        "kv_base_addr": 4096,
        "block_bytes": 4096,
        "num_prompt_tokens": len(PROMPT),
        "first_token_id": first_token_id,
        "lease_s": 30.0,
        "release_url": listener.url,
        **kw,
    }


def parse_serve(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(["model-dir", *argv])


def test_trust_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMBER_API_KEY", raising=False)
    args = parse_serve("--api-key", KA, KB, "--kv-peers", "http://p1:8001", "--public-metrics")
    assert args.api_key == [KA, KB] and args.kv_peers == ["http://p1:8001"]
    assert args.public_metrics and not args.shared_cache and args.cluster_secret is None
    assert parse_serve().api_key is None
    monkeypatch.setenv("EMBER_API_KEY", f"{KA} {KB}")
    assert parse_serve().api_key == [KA, KB]
    cfg = engine_config_from_args(parse_serve(), "s3cret")
    assert cfg.cluster_secret == "s3cret" and "s3cret" not in repr(cfg)


def test_every_route_is_public_or_internal_by_name() -> None:
    """A new route lands on the public face only if it is meant to: /v1/* or an open path."""
    app = build_app(cast(Any, SimpleNamespace()), ["tiny"])
    docs = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    paths = {getattr(r, "path", "") for r in app.routes} - docs
    unclassified = {
        p
        for p in paths
        if not p.startswith("/v1/") and p not in OPEN_PATHS | INTERNAL_PATHS | PUBLIC_PATHS
    }
    assert not unclassified
    assert {"/load", "/kv_events", "/kv/release", "/metrics"} <= paths


# -- one colocated engine with two tenants -----------------------------------------------------


@pytest.fixture(scope="module")
def tenants(server_factory) -> Server:
    return server_factory("--api-key", KA, KB)


def test_internal_routes_need_the_cluster_secret(tenants: Server) -> None:
    routes = [("GET", "/load"), ("GET", "/kv_events"), ("GET", "/metrics"), ("POST", "/kv/release")]
    for method, path in routes:
        url = tenants.url + path
        body = {"lease_id": "nope"}
        for headers in ({}, bearer(KA), {"x-ember-cluster-secret": "wrong"}):
            err = error(httpx.request(method, url, json=body, headers=headers), 401)
            assert err["type"] == "authentication_error", path
        r = httpx.request(method, url, json=body, headers=INTERNAL)
        assert r.status_code == 200, (path, r.text)
    assert httpx.get(f"{tenants.url}/health").status_code == 200


def test_api_keys_guard_the_public_face(tenants: Server) -> None:
    err = error(complete(tenants, {}, prompt="hi"), 401)
    assert err["code"] == "invalid_api_key"
    error(complete(tenants, bearer("nope"), prompt="hi"), 401)
    for key in (KA, KB):
        ok(complete(tenants, bearer(key), prompt="hi", max_tokens=2))
    ok(complete(tenants, {"Authorization": f"bearer {KA}"}, prompt="hi", max_tokens=2))
    ok(complete(tenants, INTERNAL, prompt="hi", max_tokens=2))  # a peer needs no API key


def test_a_clients_kv_transfer_params_are_ignored(tenants: Server, listener: Listener) -> None:
    plain = ok(complete(tenants, bearer(KA), prompt=PROMPT))["choices"][0]["text"]
    for first in (1, 2):  # one of them is not the greedy first token, whatever the model says
        r = complete(tenants, bearer(KA), prompt=PROMPT, kv_transfer_params=forged(listener, first))
        assert ok(r)["choices"][0]["text"] == plain
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    chat |= {"temperature": 0, "ignore_eos": True}
    url = f"{tenants.base}/chat/completions"
    want = ok(httpx.post(url, json=chat, headers=bearer(KA), timeout=60))["choices"][0]["message"]
    for first in (1, 2):
        body = chat | {"kv_transfer_params": forged(listener, first)}
        got = ok(httpx.post(url, json=body, headers=bearer(KA), timeout=60))["choices"][0]
        assert got["message"]["content"] == want["content"]
    assert listener.calls == []


def test_tenants_do_not_share_the_prefix_cache(tenants: Server) -> None:
    prompt = "tenant A's secret system prompt, " * 20  # well over one 16-token block
    assert cached(complete(tenants, bearer(KA), prompt=prompt)) == 0
    assert cached(complete(tenants, bearer(KA), prompt=prompt)) > 0  # A's own repeat hits
    assert cached(complete(tenants, bearer(KB), prompt=prompt)) == 0


def test_the_tenant_header_counts_from_a_peer_only(tenants: Server) -> None:
    prompt = "tenant A's other prompt, " * 20
    assert cached(complete(tenants, bearer(KA), prompt=prompt)) == 0
    keys = TenantKeys.load([KA])
    ns_a = keys.namespace(keys.lookup(f"Bearer {KA}"))
    spoof = {**bearer(KB), TENANT_HEADER: ns_a}
    assert cached(complete(tenants, spoof, prompt=prompt)) == 0
    # The router sends the tenant it resolved, with the cluster secret: that one is believed.
    assert cached(complete(tenants, {**INTERNAL, TENANT_HEADER: ns_a}, prompt=prompt)) > 0


def test_cache_salt_separates_caches(tenants: Server) -> None:
    prompt = "a prompt that two salts share, " * 20
    assert cached(complete(tenants, bearer(KA), prompt=prompt, cache_salt="x")) == 0
    assert cached(complete(tenants, bearer(KA), prompt=prompt, cache_salt="x")) > 0
    assert cached(complete(tenants, bearer(KA), prompt=prompt, cache_salt="y")) == 0
    assert cached(complete(tenants, bearer(KA), prompt=prompt)) == 0
    error(complete(tenants, bearer(KA), prompt="hi", cache_salt="s" * 257), 400)


# -- a prefill engine and a decode engine that trusts only it ----------------------------------


@dataclass
class PD:
    prefill: Server
    decode: Server


@pytest.fixture(scope="module")
def pd(server_factory) -> PD:
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    engine = ("--cpu-threads", "1", "--kv-lease-s", "10")
    p = server_factory(*engine, "--role", "prefill")
    d = server_factory(*engine, "--role", "decode", "--kv-peers", p.url, "--public-metrics")
    return PD(p, d)


def lease(pd: PD, prompt: list[int] = PROMPT) -> dict:
    """A real prefill leg's answer, as the router gets it."""
    r = complete(pd.prefill, INTERNAL, prompt=prompt, kv_transfer_params={"do_remote_decode": True})
    return ok(r)["kv_transfer_params"]


def decode_leg(params: dict) -> dict:
    return {**params, "do_remote_prefill": True, "do_remote_decode": False}


def test_public_metrics_opens_metrics_only(pd: PD) -> None:
    assert httpx.get(f"{pd.decode.url}/metrics").status_code == 200
    for path in ("/load", "/kv_events"):
        error(httpx.get(pd.decode.url + path), 401)
    error(httpx.get(f"{pd.prefill.url}/metrics"), 401)


def test_prefill_answers_are_signed_and_decode_reads_them(pd: PD) -> None:
    plain = ok(complete(pd.decode, {}, prompt=PROMPT))["choices"][0]["text"]
    params = lease(pd)
    assert params["signature"] and params["release_url"] == f"{pd.prefill.url}/kv/release"
    before = pd.decode.load()["remote_kv_loads"]
    r = complete(pd.decode, INTERNAL, prompt=PROMPT, kv_transfer_params=decode_leg(params))
    assert ok(r)["choices"][0]["text"] == plain
    assert pd.decode.load()["remote_kv_loads"] == before + 1
    assert pd.prefill.load()["leases"] == 0  # released, with the secret, at the peer's own URL


def test_a_decode_engine_ignores_a_clients_params(pd: PD, listener: Listener) -> None:
    plain = ok(complete(pd.decode, {}, prompt=PROMPT))["choices"][0]["text"]
    before = pd.decode.load()
    for first in (1, 2):
        r = complete(pd.decode, {}, prompt=PROMPT, kv_transfer_params=forged(listener, first))
        assert ok(r)["choices"][0]["text"] == plain
    after = pd.decode.load()
    assert listener.calls == []
    assert after["remote_kv_loads"] + after["remote_kv_failures"] == (
        before["remote_kv_loads"] + before["remote_kv_failures"]
    )


@pytest.mark.parametrize(
    "change",
    [
        {"block_ids": [0, 1, 2]},
        {"first_token_id": 1},
        {"release_url": "LISTENER"},
        {"signature": "0" * 64},
        {"signature": ""},
    ],
)
def test_altered_or_forged_params_are_refused(pd: PD, listener: Listener, change: dict) -> None:
    params = lease(pd)
    change = {k: listener.url if v == "LISTENER" else v for k, v in change.items()}
    before = pd.decode.load()["remote_kv_failures"]
    r = complete(pd.decode, INTERNAL, prompt=PROMPT, kv_transfer_params=decode_leg(params | change))
    err = error(r, 403)
    assert err["code"] == "invalid_kv_signature" and err["param"] == "kv_transfer_params"
    assert r.headers["x-ember-fault"] == "request"  # a router must not retry it elsewhere
    assert listener.calls == [] and pd.decode.load()["remote_kv_failures"] == before
    release = httpx.post(
        f"{pd.prefill.url}/kv/release", json={"lease_id": params["lease_id"]}, headers=INTERNAL
    )
    assert ok(release)["released"] is True  # nothing was read: the lease was still held


def test_kv_peers_bound_where_a_decode_engine_reads(pd: PD, listener: Listener) -> None:
    """Params signed with the cluster secret, but naming a release URL off the --kv-peers list."""
    params = forged(listener)
    del params["do_remote_prefill"]
    params["signature"] = sign_kv_params(SECRET, params)
    r = complete(pd.decode, INTERNAL, prompt=PROMPT, kv_transfer_params=decode_leg(params))
    assert error(r, 403)["code"] == "kv_peer_not_allowed"
    assert listener.calls == []


def test_logprobs_on_a_decode_leg_is_a_clear_400(pd: PD) -> None:
    params = lease(pd)
    leg = decode_leg(params)
    r = complete(pd.decode, INTERNAL, prompt=PROMPT, logprobs=1, kv_transfer_params=leg)
    assert error(r, 400)["param"] == "logprobs"
    httpx.post(
        f"{pd.prefill.url}/kv/release", json={"lease_id": params["lease_id"]}, headers=INTERNAL
    )


# -- the same pair over Mooncake, a transport with a network port -------------------------------


@pytest.fixture(scope="module")
def pd_mooncake(server_factory) -> PD:
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    engine = ("--cpu-threads", "1", "--kv-lease-s", "10", "--kv-transport", "mooncake")
    p = server_factory(*engine, "--role", "prefill")
    d = server_factory(*engine, "--role", "decode", "--kv-peers", p.url)
    return PD(p, d)


def test_mooncake_blocks_carry_tags_and_a_planted_block_is_refused(pd_mooncake: PD) -> None:
    """Before: any process that reached the Mooncake port could write a leased block, and the
    decode engine served it as cached KV. Now each block's keyed tag is checked before use: a
    planted block fails its tag, the decode engine prefills the prompt itself, the answer holds."""
    from ember.kv.transport.mooncake import MooncakeTransport

    pd = pd_mooncake
    # Each prompt is new to both engines' unsalted caches (the reference answers are salted), so
    # the decode engine reads every block of its lease.
    prompts = [[(t + shift) % 2900 + 40 for t in PROMPT] for shift in (101, 202)]
    plain = [
        ok(complete(pd.decode, {}, prompt=p, cache_salt="reference"))["choices"][0]["text"]
        for p in prompts
    ]
    params = lease(pd, prompts[0])
    assert len(params["block_tags"]) == len(params["block_ids"]) > 1
    before = pd.decode.load()
    r = complete(pd.decode, INTERNAL, prompt=prompts[0], kv_transfer_params=decode_leg(params))
    assert ok(r)["choices"][0]["text"] == plain[0]
    assert pd.decode.load()["remote_kv_loads"] == before["remote_kv_loads"] + 1

    attacker = MooncakeTransport()  # another local process, as an attacker would be
    params = lease(pd, prompts[1])
    size = params["block_bytes"]
    junk = torch.full((size,), 0x21, dtype=torch.uint8)
    src = attacker.register(junk)
    target = params["kv_base_addr"] + params["block_ids"][1] * size
    attacker.write(params["transfer_address"], [src], [target], [size])
    before = pd.decode.load()
    r = complete(pd.decode, INTERNAL, prompt=prompts[1], kv_transfer_params=decode_leg(params))
    assert ok(r)["choices"][0]["text"] == plain[1]  # recomputed, not read from the planted block
    after = pd.decode.load()
    assert after["remote_kv_failures"] == before["remote_kv_failures"] + 1
    assert after["remote_kv_loads"] == before["remote_kv_loads"]
    assert pd.prefill.load()["leases"] == 0
    attacker.close()


def test_tags_travel_signed(pd_mooncake: PD) -> None:
    params = lease(pd_mooncake)
    tags = list(params["block_tags"])
    tags[0] = "0" * 32
    r = complete(
        pd_mooncake.decode,
        INTERNAL,
        prompt=PROMPT,
        kv_transfer_params=decode_leg(params | {"block_tags": tags}),
    )
    assert error(r, 403)["code"] == "invalid_kv_signature"
    httpx.post(
        f"{pd_mooncake.prefill.url}/kv/release",
        json={"lease_id": params["lease_id"]},
        headers=INTERNAL,
    )
