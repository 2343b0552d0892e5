"""Requests that ask for logprobs of their prompt (`echo` with `logprobs`, vLLM's `prompt_logprobs`)
or of their first token through `ember router` with prefill/decode disaggregation: they run on one
engine in a single leg (a split would sample the first token, and score the prompt, on the prefill
engine, whose answer the client never sees), first over scripted engines, then over real ones."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.router.conftest import Processes
from tests.servers import Server, start_router, start_server, wait_healthy

LONG_PROMPT = "word " * 600
"""Over 256 tokens by the router's estimate: a request without logprobs is split."""


@pytest.mark.parametrize(
    "path,extra",
    [
        ("/v1/completions", {"prompt_logprobs": 0}),
        ("/v1/completions", {"echo": True, "logprobs": 1, "max_tokens": 0}),
        ("/v1/completions", {"logprobs": 0}),
        ("/v1/chat/completions", {"prompt_logprobs": 2}),
        ("/v1/chat/completions", {"logprobs": True}),
    ],
)
def test_scoring_requests_take_one_leg(procs: Processes, path: str, extra: dict) -> None:
    prefill, decode = procs.engine(role="prefill"), procs.engine(role="decode")
    router = procs.router(prefill=[prefill], decode=[decode])
    if path == "/v1/completions":
        body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 5}
    else:
        body = {"model": "tiny", "messages": [{"role": "user", "content": LONG_PROMPT}]}
    # The control: the same prompt without logprobs is split.
    r = httpx.post(router.url + path, json=body, timeout=20)
    assert r.status_code == 200, r.text
    assert len(prefill.posts(path)) == 1
    r = httpx.post(router.url + path, json={**body, **extra}, timeout=20)
    assert r.status_code == 200, r.text
    assert len(prefill.posts(path)) == 1  # no second prefill leg
    leg = decode.posts(path)[-1].body
    assert "kv_transfer_params" not in leg
    assert {k: leg[k] for k in extra} == extra


ENGINE = ("--cpu-threads", "1", "--max-model-len", "2048")


@dataclass
class Cluster:
    prefill: Server
    decode: Server
    router: Server


@pytest.fixture(scope="module")
def cluster(tiny_model_dir) -> Iterator[Cluster]:
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    llama: Path = tiny_model_dir("llama")
    engines = [
        start_server(llama, *ENGINE, "--role", role, wait=False) for role in ("prefill", "decode")
    ]
    router = None
    try:
        for e in engines:
            wait_healthy(e)
        router = start_router(llama, prefill=engines[:1], decode=engines[1:])
        yield Cluster(engines[0], engines[1], router)
    finally:
        for s in [*engines, *([router] if router else [])]:
            s.stop()


def test_prompt_scores_through_a_disaggregated_router(cluster: Cluster) -> None:
    """The decode engine scores the prompt in place: the router's answer is the one a single
    engine gives, and no KV moved for it."""
    before = cluster.decode.load()["remote_kv_loads"]
    prompt = " ".join(f"item{i % 37} value{i % 11}" for i in range(200))
    cases = [
        ("/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1}),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 3, "prompt_logprobs": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                  "max_tokens": 3, "prompt_logprobs": 0}),
    ]  # fmt: skip
    for path, body in cases:
        body = {"model": "tiny", "temperature": 0, "ignore_eos": True, **body}
        want = httpx.post(cluster.decode.url + path, json=body, timeout=120)
        got = httpx.post(cluster.router.url + path, json=body, timeout=120)
        assert got.status_code == want.status_code == 200, got.text
        w, g = want.json(), got.json()
        assert g["usage"]["prompt_tokens"] > 256  # long enough to be split otherwise
        assert g["choices"] == w["choices"]
        assert g.get("prompt_logprobs") == w.get("prompt_logprobs")
        choice = g["choices"][0]  # the scores came back (the legacy object, per choice, or top)
        assert choice.get("logprobs") or choice.get("prompt_logprobs") or g.get("prompt_logprobs")
    assert cluster.decode.load()["remote_kv_loads"] == before
