"""Fuzz the router, with real engines behind it (a prefill and a decode engine): the hand-written
hostile values of the engine's edge tests and schemathesis cases generated from the engine's own
OpenAPI schema, all sent through `ember router`. No 5xx, every error OpenAI-shaped, no traceback,
and the router and both engines healthy afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.server.hostile_cases import MAY_SUCCEED, chat_cases, completion_cases, encode
from tests.servers import Server, start_router, start_server

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")

ENGINE = ("--cpu-threads", "1", "--max-model-len", "256", "--max-num-seqs", "32")
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def routed(tiny_model_dir) -> Iterator[tuple[Server, list[Server]]]:
    model = tiny_model_dir("qwen3")
    prefill = start_server(model, "--role", "prefill", *ENGINE)
    decode = start_server(model, "--role", "decode", "--kv-peers", prefill.url, *ENGINE)
    router = start_router(model, prefill=[prefill], decode=[decode])
    yield router, [prefill, decode]
    for s in (router, decode, prefill):
        s.stop()


def assert_openai_error(r: httpx.Response) -> None:
    assert "Traceback" not in r.text, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] is None or isinstance(err["code"], str), err
    assert err["type"] in {"invalid_request_error", "authentication_error", "not_found_error",
                           "rate_limit_error", "server_error"}  # fmt: skip


def assert_all_healthy(router: Server, engines: list[Server]) -> None:
    for s in (router, *engines):
        assert httpx.get(f"{s.url}/health", timeout=5).status_code == 200, s.url


@pytest.mark.parametrize(
    ("path", "cases"),
    [("/v1/chat/completions", chat_cases()), ("/v1/completions", completion_cases())],
    ids=["chat", "completions"],
)
def test_hostile_values_through_the_router(routed, path: str, cases) -> None:
    router, engines = routed
    wrong: list[str] = []
    for name, body in cases:
        r = httpx.post(router.url + path, content=encode(body), headers=JSON, timeout=60)
        if r.status_code == 200 and name in MAY_SUCCEED:
            continue
        if r.status_code != 400:
            wrong.append(f"{name}: {r.status_code} {r.text[:120]}")
            continue
        assert_openai_error(r)
    assert not wrong, "\n".join(wrong)
    assert_all_healthy(router, engines)


def test_deeper_than_the_encoder_can_go_is_a_400(routed) -> None:
    router, _ = routed
    deep = '{"messages": [{"role": "user", "content": "hi"}], "x": ' + "[" * 600 + "]" * 600 + "}"
    r = httpx.post(f"{router.url}/v1/chat/completions", content=deep, headers=JSON, timeout=30)
    assert r.status_code == 400, r.text
    assert_openai_error(r)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_schemathesis_through_the_router(routed, path: str) -> None:
    router, engines = routed
    # The router proxies the engine's API: fuzz it with the engine's own schema.
    spec = httpx.get(f"{engines[1].url}/openapi.json").json()
    schema = schemathesis.openapi.from_dict(spec).include(path=path, method="POST")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) == 1
    statuses: set[int] = set()

    @given(case=ops[0].as_strategy())
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        response = case.call(base_url=router.url, timeout=60)
        case.validate_response(response, checks=[not_a_server_error])
        statuses.add(response.status_code)
        if response.status_code >= 400:
            assert_openai_error(response)

    check()
    assert statuses  # the fuzzer really sent requests
    assert_all_healthy(router, engines)
