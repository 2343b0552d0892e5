"""Chat and completions prepare a small request (token ids or a short text, no grammar; for chat
no tools either) on the event loop and a large one, one with a grammar or a chat with tools in a
worker thread (INLINE_PREPARE_SIZE): both ways give the same answer and the same 400s, and the
thread is taken exactly where the rule says."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ember.engine.async_llm import AsyncLLM
from ember.engine.config import EngineConfig
from ember.server import serving, serving_chat, serving_completion
from ember.server.api_server import build_app
from tests.server.test_vllm_compat import assert_openai_error

IDS = [5, 17, 99, 3, 42, 8, 250, 11]


@pytest.fixture(scope="module")
def web(tiny_model_dir) -> Iterator[TestClient]:
    engine = AsyncLLM(EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=256))
    with TestClient(build_app(engine, ["tiny"]), raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine did not start"
            time.sleep(0.1)
        yield client


@pytest.fixture
def threads(monkeypatch) -> list[str]:
    """The names of what the completion handler sent to a worker thread."""
    sent: list[str] = []
    real = asyncio.to_thread

    async def recording(fn: Any, *args: Any) -> Any:
        sent.append(fn.__name__)
        return await real(fn, *args)

    # One asyncio module: patched once, seen by both handlers.
    assert serving_chat.asyncio is serving_completion.asyncio
    monkeypatch.setattr(serving_completion.asyncio, "to_thread", recording)
    return sent


def _text(web: TestClient, **body: Any) -> str:
    full = {"model": "tiny", "max_tokens": 6, "temperature": 0, **body}
    r = web.post("/v1/completions", json=full)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_small_requests_skip_the_thread_large_ones_take_it(
    web: TestClient, threads: list[str], monkeypatch
) -> None:
    inline = _text(web, prompt=IDS)
    text = _text(web, prompt="hello there")
    several = _text(web, prompt=[IDS, IDS[:4]])
    assert threads == []
    # The same requests over the limit: prepared in a thread, answered alike.
    monkeypatch.setattr(serving, "INLINE_PREPARE_SIZE", len(IDS) - 1)
    assert _text(web, prompt=IDS) == inline
    assert _text(web, prompt="hello there") == text
    assert _text(web, prompt=[IDS, IDS[:4]]) == several
    assert threads == ["_prepare"] * 3
    # At the limit exactly: inline again (the sum of every prompt's ids or characters counts).
    monkeypatch.setattr(serving, "INLINE_PREPARE_SIZE", len(IDS) + 4)
    assert _text(web, prompt=[IDS, IDS[:4]]) == several
    assert threads == ["_prepare"] * 3


def test_a_grammar_always_takes_the_thread(web: TestClient, threads: list[str]) -> None:
    grammar = {"structured_outputs": {"regex": "(yes|no)"}}
    assert _text(web, prompt=IDS, **grammar) in ("yes", "no")
    assert threads == ["_prepare"]


def _chat(web: TestClient, **body: Any) -> dict:
    full = {"model": "tiny", "max_tokens": 6, "temperature": 0, **body}
    r = web.post("/v1/chat/completions", json=full)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


HI = [{"role": "user", "content": "hello there"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_a_small_chat_skips_the_thread(web: TestClient, threads: list[str], monkeypatch) -> None:
    inline = _chat(web, messages=HI)
    assert threads == []
    monkeypatch.setattr(serving, "INLINE_PREPARE_SIZE", len("hello there") - 1)
    assert _chat(web, messages=HI) == inline
    assert threads == ["_prepare"]


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [TOOL]},
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"regex": "(yes|no)"}},
    ],
    ids=["tools", "response-format", "structured-outputs"],
)
def test_a_chat_with_tools_or_a_grammar_takes_the_thread(
    web: TestClient, threads: list[str], extra: dict
) -> None:
    _chat(web, messages=HI, **extra)
    assert threads == ["_prepare"]


def test_a_chat_carrying_tool_calls_takes_the_thread(web: TestClient, threads: list[str]) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    _chat(web, messages=messages)
    assert threads == ["_prepare"]


@pytest.mark.parametrize("limit", [10_000, 0])
@pytest.mark.parametrize(
    "path,body,param,words",
    [
        ("/v1/completions", {"prompt": [5, 10**9]}, "prompt", "out of range"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]},
         "messages", "maximum context length"),
    ],
    ids=["completion-bad-id", "chat-too-long"],
)  # fmt: skip
def test_bad_input_is_the_same_400_either_way(
    web: TestClient, threads: list[str], monkeypatch, limit: int, path, body, param, words
) -> None:
    monkeypatch.setattr(serving, "INLINE_PREPARE_SIZE", limit)
    err = assert_openai_error(web.post(path, json={"model": "tiny", "max_tokens": 2, **body}), 400)
    assert err["param"] == param and words in err["message"], err
    assert threads == ([] if limit else ["_prepare"])
    assert _text(web, prompt=IDS) and _chat(web, messages=HI)  # the server goes on
