"""Fuzz the two completion routes from the server's own OpenAPI schema: no input makes a 5xx."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.server.conftest import Server

ROUTES = ["/v1/completions", "/v1/chat/completions"]


@pytest.fixture(scope="module")
def fuzz_server(server_factory) -> Server:
    # A short context keeps every generated request cheap on the CPU.
    return server_factory("--max-model-len", "48", "--max-num-seqs", "64")


@pytest.mark.parametrize("path", ROUTES)
def test_no_input_makes_a_server_error(fuzz_server: Server, path: str) -> None:
    spec = httpx.get(f"{fuzz_server.url}/openapi.json").json()
    schema = schemathesis.openapi.from_dict(spec).include(path=path, method="POST")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) == 1
    statuses: set[int] = set()

    @given(case=ops[0].as_strategy())
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        response = case.call(base_url=fuzz_server.url, timeout=60)
        case.validate_response(response, checks=[not_a_server_error])
        statuses.add(response.status_code)
        assert "Traceback" not in response.text
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] is None or isinstance(error["code"], str)

    check()
    assert statuses  # the fuzzer really sent requests
    assert httpx.get(f"{fuzz_server.url}/health", timeout=5).status_code == 200
