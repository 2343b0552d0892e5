"""A request's `"speculative": false` reaches the engine's SamplingParams on both routes and keeps
it out of speculation (the /metrics drafts do not move); anything but a boolean is a 400 that
names the field."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from ember.engine.async_llm import AsyncLLM
from ember.engine.config import EngineConfig
from ember.sampling_params import SamplingParams
from ember.server.api_server import build_app
from ember.server.protocol import ChatCompletionRequest, CompletionRequest
from ember.spec_decode.config import SpeculativeConfig
from ember.trust import internal_headers

SECRET = "test-secret"

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    "cls,body", [(ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)]
)
def test_the_field_sets_sampling_params(cls: type, body: dict) -> None:
    assert cls.model_validate(body).sampling_params(2, None).speculative is True
    off = cls.model_validate({**body, "speculative": False})
    assert off.sampling_params(2, None).speculative is False


@pytest.mark.parametrize("value", ["false", 0, 1, None, [], {}])
def test_only_a_boolean_is_taken(value: object) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**CHAT, "speculative": value})


class Served:
    """An in-process app on the tiny model whose engine records each request's SamplingParams."""

    def __init__(self, web: TestClient, seen: list[SamplingParams]) -> None:
        self.web = web
        self.seen = seen


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3)
    engine = AsyncLLM(
        EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=256, speculative=spec)
    )
    seen: list[SamplingParams] = []
    add = engine.add_request

    async def recording(request_id: str, prompt: Any, params: SamplingParams, *a: Any) -> Any:
        seen.append(params)
        return await add(request_id, prompt, params, *a)

    engine.add_request = recording  # type: ignore[method-assign]
    app = build_app(engine, ["tiny"], secret=SECRET)
    with TestClient(app, raise_server_exceptions=False) as web:
        deadline = time.monotonic() + 60
        while web.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine did not start"
            time.sleep(0.1)
        yield Served(web, seen)


@pytest.mark.parametrize(
    "path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
def test_the_field_reaches_the_engine(served: Served, path: str, body: dict) -> None:
    for given, want in ((None, True), (True, True), (False, False)):
        sent = body if given is None else {**body, "speculative": given}
        r = served.web.post(path, json=sent)
        assert r.status_code == 200, r.text
        assert served.seen[-1].speculative is want
    # A stream takes the field the same way.
    r = served.web.post(path, json={**body, "speculative": False, "stream": True})
    assert r.status_code == 200 and "data: [DONE]" in r.text
    assert served.seen[-1].speculative is False


def drafts(served: Served) -> float:
    r = served.web.get("/metrics", headers=internal_headers(SECRET))
    for line in r.text.splitlines():
        if line.startswith("ember:spec_decode_num_drafts_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no drafts counter in\n{r.text}")


def test_off_a_request_gets_no_drafts(served: Served) -> None:
    """Greedy, long enough for the tiny model's output to repeat itself (measured: 16 drafts):
    n-gram drafts unless the request says no."""
    body = {
        **COMPLETION,
        "prompt": "a b c d " * 4,
        "max_tokens": 128,
        "temperature": 0,
        "ignore_eos": True,
    }
    answers = {}
    for speculative in (False, True):
        before = drafts(served)
        r = served.web.post("/v1/completions", json={**body, "speculative": speculative})
        assert r.status_code == 200, r.text
        answers[speculative] = r.json()["choices"][0]["text"]
        assert (drafts(served) > before) is speculative
    assert answers[False] == answers[True]  # greedy: the same tokens either way


@pytest.mark.parametrize(
    "path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
@pytest.mark.parametrize("value", ["false", 0, None])
def test_a_non_boolean_is_an_openai_400(
    served: Served, path: str, body: dict, value: object
) -> None:
    before = len(served.seen)
    r = served.web.post(path, json={**body, "speculative": value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == "speculative"
    assert len(served.seen) == before  # never reached the engine
