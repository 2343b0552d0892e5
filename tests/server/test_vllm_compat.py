"""What clients written for vLLM count on: max_tokens lowered to what the context has
left, /tokenize and /detokenize, and one OpenAI error shape on every error path."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from ember.engine.async_llm import AsyncLLM
from ember.engine.config import EngineConfig
from ember.server.api_server import build_app
from ember.tokenizer.tokenizer import Tokenizer
from ember.trust import INTERNAL_HEADER
from tests.server.conftest import Server

KEY = "compat-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_LEN = 1024
"""The test servers' --max-model-len."""
OPENAI_ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "rate_limit_error",
        "server_error",
    }
)
"""The `type`s of OpenAI's error objects (snake_case; never a class name like NotFoundError)."""


@pytest.fixture(scope="module")
def llama(server_factory) -> Server:
    """Tiny Llama (its tokenizer adds a bos token, so add_special_tokens shows), API key set,
    room for one running and one waiting sequence (429 is reachable), a small body limit."""
    return server_factory(
        "--max-num-seqs", "1", "--max-waiting", "1", "--max-body-bytes", "65536",
        "--max-connections", "8", arch="llama", api_key=KEY,
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(llama: Server) -> Iterator[httpx.Client]:
    # One keep-alive connection: the connection count stays put for the 503 test.
    with httpx.Client(base_url=llama.url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir("llama"))


def long_messages(tokenizer: Tokenizer, room: int) -> tuple[list[dict], int]:
    """A conversation whose rendered prompt leaves between 1 and `room` tokens of the context."""

    def rendered(words: int) -> tuple[list[dict], int]:
        msgs = [{"role": "user", "content": "hello world " * words}]
        text = tokenizer.apply_chat_template(msgs)
        return msgs, len(tokenizer.encode(text, add_special_tokens=False))

    lo, hi = 1, MAX_LEN  # the longest conversation that fits: a binary search on its words
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if rendered(mid)[1] < MAX_LEN else (lo, mid - 1)
    msgs, n = rendered(lo)
    assert MAX_LEN - room <= n < MAX_LEN
    return msgs, n


# -- max_tokens as vLLM treats it ---------------------------------------------------------------


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("stream", [False, True])
def test_chat_max_tokens_past_the_context_is_lowered(
    client: httpx.Client, tokenizer: Tokenizer, field: str, stream: bool
) -> None:
    """OpenCode sends max_tokens 32000 with a 32768 context whatever the prompt: vLLM runs it with
    what is left, and so does ember (it answered 400 context_length_exceeded)."""
    msgs, prompt_len = long_messages(tokenizer, room=20)
    body = {
        "model": "tiny", "messages": msgs, field: MAX_LEN - 1, "ignore_eos": True,
        "stream": stream, "stream_options": {"include_usage": True} if stream else None,
    }  # fmt: skip
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks
        usage = chunks[-1]["usage"]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    else:
        usage, finish = r.json()["usage"], r.json()["choices"][0]["finish_reason"]
    assert usage["prompt_tokens"] == prompt_len
    assert usage["completion_tokens"] == MAX_LEN - prompt_len
    assert finish == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_max_tokens_past_the_context_is_lowered(llama: Server, stream: bool) -> None:
    prompt = [7] * (MAX_LEN - 10)
    r = llama.client().completions.create(
        model="tiny", prompt=prompt, max_tokens=500, extra_body={"ignore_eos": True},
        stream=stream, stream_options={"include_usage": True} if stream else openai.NOT_GIVEN,
    )  # fmt: skip
    if stream:
        chunks = list(r)
        usage = chunks[-1].usage
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text
    else:
        usage = r.usage
        assert r.choices[0].finish_reason == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (MAX_LEN - 10, 10)


def test_max_tokens_up_to_max_model_len_is_accepted(llama: Server) -> None:
    r = llama.client().completions.create(
        model="tiny",
        prompt=[7] * (MAX_LEN - 4),
        max_tokens=MAX_LEN,
        extra_body={"ignore_eos": True},
    )
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (4, "length")


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"max_tokens": 32000}),
        ("/v1/chat/completions", {"max_completion_tokens": 32000}),
        ("/v1/completions", {"max_tokens": 32000}),
    ],
)
def test_max_tokens_past_max_model_len_itself_is_lowered(
    client: httpx.Client, path: str, body: dict
) -> None:
    """OpenCode's max_tokens=32000 against a smaller context: vLLM refuses it (`max_tokens=N
    cannot be greater than max_model_len=M`); ember runs it with the room the prompt leaves."""
    prompt = (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "a"}
    )
    r = client.post(path, json={"model": "tiny", **prompt, **body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage, choice = r.json()["usage"], r.json()["choices"][0]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_LEN
    assert choice["finish_reason"] == "length"


def test_a_prompt_that_leaves_no_room_is_still_400(client: httpx.Client) -> None:
    for prompt in ([7] * MAX_LEN, [7] * (MAX_LEN + 5)):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 5}
        err = assert_openai_error(client.post("/v1/completions", json=body), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        assert f"maximum context length is {MAX_LEN}" in err["message"]


# -- /tokenize and /detokenize ------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


@pytest.mark.parametrize("add_special_tokens", [None, True, False])
def test_tokenize_a_prompt_agrees_with_the_tokenizer_and_completions(
    client: httpx.Client, tokenizer: Tokenizer, add_special_tokens: bool | None
) -> None:
    text = "The quick brown fox jumps over the lazy dog. <|im_end|> é 漢字"
    body: dict = {"model": "tiny", "prompt": text}
    if add_special_tokens is not None:
        body["add_special_tokens"] = add_special_tokens
    r = client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    want = tokenizer.encode(text, add_special_tokens=add_special_tokens is not False)
    assert got == {"count": len(want), "max_model_len": MAX_LEN, "tokens": want, "token_strs": None}
    if add_special_tokens is None:  # the default is what /v1/completions runs
        assert want[0] == tokenizer.bos_token_id
        usage = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 1}
        ).json()["usage"]
        assert usage["prompt_tokens"] == got["count"]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_a_conversation_agrees_with_the_chat_template_and_chat(
    client: httpx.Client, tokenizer: Tokenizer, add_generation_prompt: bool
) -> None:
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Read a.txt"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "hello"},
    ]
    body = {"messages": msgs, "tools": TOOLS, "add_generation_prompt": add_generation_prompt}
    r = client.post("/tokenize", json={"model": "tiny", **body, "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    # The template renders what the chat route's messages become (tool-call arguments parsed).
    template_msgs = [dict(m) for m in msgs]
    template_msgs[2] = {**msgs[2], "tool_calls": [{**msgs[2]["tool_calls"][0]}]}
    template_msgs[2]["tool_calls"][0]["function"] = {"name": "read", "arguments": {}}
    text = tokenizer.apply_chat_template(
        template_msgs, tools=TOOLS, add_generation_prompt=add_generation_prompt
    )
    want = tokenizer.encode(text, add_special_tokens=False)
    assert got["tokens"] == want and got["count"] == len(want)
    assert got["token_strs"] == [tokenizer.id_to_token(t) for t in want]
    if add_generation_prompt:
        chat = client.post("/v1/chat/completions", json={"model": "tiny", **body, "max_tokens": 1})
        assert chat.json()["usage"]["prompt_tokens"] == got["count"]


def test_detokenize_round_trips(client: httpx.Client, tokenizer: Tokenizer) -> None:
    text = "def main():\n    return 'ok' <|im_end|>"
    ids = tokenizer.encode(text)
    r = client.post("/detokenize", json={"model": "tiny", "tokens": ids})
    assert r.status_code == 200, r.text
    # As vLLM: special tokens (the bos, <|im_end|>) stay in the text.
    assert r.json() == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert r.json()["prompt"].endswith(text)
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
        ("/detokenize", {"tokens": ["1"]}, "tokens.0"),
        ("/detokenize", {"tokens": [1.0]}, "tokens.0"),
        ("/detokenize", {}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, None),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
         "chat_template"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                       "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", [1, 2], None),
    ],
)  # fmt: skip
def test_tokenize_bodies_are_validated(
    client: httpx.Client, path: str, body: object, param: str | None
) -> None:
    err = assert_openai_error(client.post(path, json=body), 400)
    if param is not None:
        assert err["param"] == param


# -- one error shape on every path --------------------------------------------------------------


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    """OpenAI's error object, exactly: what the openai SDK and agent harnesses parse."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert "Traceback" not in err["message"] and 'File "' not in err["message"], err
    assert err["type"] in OPENAI_ERROR_TYPES, err
    assert err["code"] is None or isinstance(err["code"], str), err
    assert err["param"] is None or isinstance(err["param"], str), err
    return err


def test_every_error_path_has_the_openai_shape(llama: Server, client: httpx.Client) -> None:
    url = llama.url
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases: list[tuple[httpx.Response, int, str | None]] = [
        (httpx.post(f"{url}/v1/chat/completions", json=chat), 401, "invalid_api_key"),
        (httpx.post(f"{url}/tokenize", json={"prompt": "x"}), 401, "invalid_api_key"),
        (
            httpx.post(f"{url}/v1/completions", json=chat, headers={"Authorization": "Bearer x"}),
            401,
            "invalid_api_key",
        ),
        (client.get("/load"), 401, "invalid_cluster_secret"),
        (client.get("/kv_events", headers={INTERNAL_HEADER: "wrong"}), 401, None),
        (client.get("/v2/nothing"), 404, None),
        (client.post("/v1/chat/completions", json={**chat, "model": "gpt-9"}), 404, None),
        (client.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}), 404, None),
        (client.get("/v1/chat/completions"), 405, None),
        (client.get("/tokenize"), 405, None),
        (client.post("/v1/completions", json={"prompt": "x" * 70000}), 413, None),
        (client.post("/v1/chat/completions", json={**chat, "temperature": -1}), 400, None),
        (client.post("/v1/chat/completions", json={**chat, "n": "2"}), 400, None),
        (
            client.post(
                "/v1/chat/completions",
                content=b"{not json",
                headers={"content-type": "application/json"},
            ),
            400,
            None,
        ),
        (client.post("/tokenize", content=b'{"prompt": "\\ud800"}'), 400, None),
    ]
    for r, status, code in cases:
        err = assert_openai_error(r, status)
        if code is not None:
            assert err["code"] == code, err
        if status == 404 and "model" in r.request.content.decode():
            assert (err["type"], err["code"], err["param"]) == (
                "not_found_error",
                "model_not_found",
                "model",
            )
        if status == 405:
            assert "POST" in r.headers["allow"]
    with pytest.raises(openai.NotFoundError):
        llama.client().chat.completions.create(model="gpt-9", messages=chat["messages"])


def test_429_has_the_openai_shape(llama: Server, client: httpx.Client) -> None:
    long = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    busy = {"model": "tiny", "prompt": "y", "max_tokens": 1, "n": 2}
    with (
        httpx.Client(base_url=llama.url, headers=AUTH, timeout=60) as other,
        other.stream("POST", "/v1/completions", json=long) as held,
    ):
        assert held.status_code == 200
        lines = held.iter_lines()  # kept referenced: dropping it would close the connection
        next(lines)
        assert llama.load()["in_flight"] == 1  # one of the two places is taken
        err = assert_openai_error(client.post("/v1/completions", json=busy), 429)
        assert err["code"] == "too_many_requests"
    assert client.post("/v1/completions", json={**busy, "n": 1}).status_code == 200


def test_503_over_the_connection_limit_has_the_openai_shape(llama: Server) -> None:
    host, port = llama.url.removeprefix("http://").split(":")
    held: list[socket.socket] = []
    answer = b""
    try:
        for _ in range(16):  # --max-connections 8, plus whatever other tests hold
            s = socket.create_connection((host, int(port)))
            held.append(s)
            s.settimeout(0.3)
            try:
                answer = s.recv(65536)
            except TimeoutError:
                continue
            break
    finally:
        for s in held:
            s.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), answer
    r = httpx.Response(503, headers={"content-type": "application/json"}, content=body)
    assert assert_openai_error(r, 503)["code"] == "too_many_connections"
    time.sleep(0.2)  # the held sockets' close reaches the server before the next test


def test_503_while_loading_and_draining_has_the_openai_shape(tiny_model_dir) -> None:
    """In-process (no lifespan, so the engine never starts): a real app, its engine not ready,
    then marked draining as a SIGTERM marks it."""
    engine = AsyncLLM(EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=MAX_LEN))
    app = build_app(engine, ["tiny"])
    web = TestClient(app, raise_server_exceptions=False)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    err = assert_openai_error(web.post("/v1/chat/completions", json=chat), 503)
    assert "not ready" in err["message"]
    # /tokenize needs only the tokenizer: it answers while the model loads.
    assert web.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    app.state.draining = True
    r = web.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert "shutting down" in assert_openai_error(r, 503)["message"]
    assert r.headers["retry-after"] == "1"
