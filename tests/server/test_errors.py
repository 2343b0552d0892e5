"""Bad input gets a clear 4xx with an OpenAI error object and loses nothing; never a 500."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from ember.trust import internal_headers
from tests.server.conftest import Server
from tests.servers import SECRET

MSGS = [{"role": "user", "content": "hi"}]


def post(server: Server, path: str, body: object, **kw) -> httpx.Response:
    return httpx.post(f"{server.base}{path}", json=body, timeout=30, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": "tiny", "messages": MSGS, "temperature": -1}, "temperature"),
        ({"model": "tiny", "messages": MSGS, "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "messages": MSGS, "max_tokens": 2**31}, "max_tokens"),  # past int32
        ({"model": "tiny", "messages": MSGS, "top_p": 0}, "top_p"),
        ({"model": "tiny", "messages": MSGS, "n": 0}, "n"),
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, None),
        ({"model": "tiny", "messages": [{"role": "user"}]}, None),
        ({"model": "tiny", "messages": "hello"}, "messages"),
        ({"model": "tiny", "messages": MSGS, "tools": [{"type": "function"}]}, None),
        (
            {
                "model": "tiny",
                "messages": MSGS,
                "tools": [{"type": "function", "function": {"name": "bad name!"}}],
            },
            None,
        ),
        ({"model": "tiny", "messages": MSGS, "tool_choice": "required"}, None),
        ({"model": "tiny", "messages": MSGS, "stop": [""]}, "stop"),
        ({"model": "tiny", "messages": MSGS, "top_logprobs": 3}, None),
    ],
)
def test_invalid_chat_parameters_are_400(server: Server, body: dict, param: str | None) -> None:
    assert_error(post(server, "/chat/completions", body), 400, param)


def test_context_overflow_names_the_limit(server: Server) -> None:
    # A max_tokens past what the prompt leaves is lowered, as vLLM does (test_vllm_compat.py);
    # a prompt that leaves no room at all is refused.
    err = assert_error(post(server, "/completions", {"model": "tiny", "prompt": [5] * 1024}), 400)
    assert "maximum context length is 1024" in err["message"]
    assert err["code"] == "context_length_exceeded"


def test_malformed_json_and_wrong_types(server: Server) -> None:
    r = httpx.post(
        f"{server.base}/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert_error(r, 400)
    assert_error(post(server, "/completions", {"model": "tiny"}), 400, "prompt")
    assert_error(post(server, "/completions", {"model": "tiny", "prompt": []}), 400)
    assert_error(post(server, "/completions", {"model": "tiny", "prompt": [[1, 2], [-3]]}), 400)


def test_unknown_model_and_route_are_404(server: Server) -> None:
    err = assert_error(post(server, "/chat/completions", {"model": "gpt-9", "messages": MSGS}), 404)
    assert "gpt-9" in err["message"]
    assert (err["type"], err["code"]) == ("not_found_error", "model_not_found")
    assert_error(httpx.get(f"{server.url}/v2/nothing"), 404)
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-9", messages=MSGS)


def test_openai_client_sees_bad_request(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="tiny", messages=MSGS, temperature=-2)
    assert "temperature" in str(e.value)


def test_body_size_limit_is_413(server_factory) -> None:
    s = server_factory("--max-body-bytes", "2000")
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_error(post(s, "/chat/completions", big), 413)

    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        yield b"y" * 5000
        yield b'"}'

    r = httpx.post(
        f"{s.base}/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_error(r, 413)
    assert (
        post(s, "/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 2}).status_code
        == 200
    )


def test_api_key_required_everywhere_but_health(server_factory) -> None:
    s = server_factory(api_key="sekrit")
    assert httpx.get(f"{s.url}/health").status_code == 200
    for path in ("/v1/models", "/load", "/metrics"):
        assert_error(httpx.get(f"{s.url}{path}"), 401)
    assert_error(post(s, "/completions", {"model": "tiny", "prompt": "x"}), 401)
    wrong = {"Authorization": "Bearer nope"}
    assert_error(post(s, "/completions", {"model": "tiny", "prompt": "x"}, headers=wrong), 401)
    with pytest.raises(openai.AuthenticationError):
        s.client(api_key="nope").models.list()
    assert [m.id for m in s.client().models.list().data] == ["tiny"]
    # The internal face takes the cluster secret, not an API key.
    assert_error(httpx.get(f"{s.url}/load", headers={"Authorization": "Bearer sekrit"}), 401)
    assert httpx.get(f"{s.url}/load", headers=internal_headers(SECRET)).status_code == 200


def test_queue_bound_gives_429_with_retry_after(server_factory) -> None:
    s = server_factory("--max-num-seqs", "1", "--max-waiting", "1")
    body = {"model": "tiny", "prompt": "count", "max_tokens": 1000, "ignore_eos": True}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            first = [
                asyncio.create_task(client.post(f"{s.base}/completions", json=body))
                for _ in range(2)
            ]
            # Both admitted (one running, one waiting): asked of the server, not guessed with a
            # sleep (a fixed 1 s failed once on a fast run: 400 tokens took less).
            for _ in range(500):
                load = await client.get(f"{s.url}/load", headers=internal_headers(SECRET))
                if load.json()["in_flight"] >= 2:
                    break
                await asyncio.sleep(0.01)
            third = await client.post(f"{s.base}/completions", json=body)
            return [third, *await asyncio.gather(*first)]

    third, *ok = asyncio.run(run())
    err = assert_error(third, 429)
    assert third.headers["retry-after"] == "1" and err["code"] == "too_many_requests"
    assert all(r.status_code == 200 for r in ok)
