"""What agent clients and their benchmarks need from the router, against real engines:
two prefill engines and a decode engine that take one request at a time (so requests queue), behind
`ember router`. A session's turns grow its KV in one place; a queue longer than the stall timeout
ends in answers, not 503s; /tokenize and /detokenize answer as the engines do; every error the
router writes has the engine's OpenAI shape."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from ember.router.prompt import PromptReader
from ember.tokenizer.tokenizer import Tokenizer
from ember.trust import internal_headers
from tests.router.conftest import Processes
from tests.router.test_pd import ENGINE, chat_body, long_text, stream
from tests.servers import (
    SECRET,
    PDCluster,
    Server,
    pd_cluster,
    start_router,
    start_server,
    wait_router_caught_up,
)

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")

QUEUED = ("--max-num-seqs", "1")
"""Each engine runs one request at a time: concurrent requests wait in its queue."""
BLOCK = 16
KEY = "sk-client"


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(llama: Path) -> Iterator[PDCluster]:
    with pd_cluster(llama, *ENGINE, *QUEUED) as c:
        yield c


def metric(router: Server, name: str) -> float:
    text = httpx.get(f"{router.url}/metrics", headers=internal_headers(SECRET)).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))


def test_a_session_grows_its_kv_on_one_prefill_engine(cluster: PDCluster) -> None:
    """Turn 2 adds under 256 uncached tokens: it once ran whole on the decode engine, and turn 3
    on the session's prefill engine recomputed it. Now every turn prefills on that one engine,
    and each turn's cached_tokens cover the turns before it."""
    headers = {"x-session-affinity": "ses_opencode", "x-session-id": "ses_opencode"}
    queries = {s.url: s.load()["prefix_cache_queries"] for s in cluster.prefill}
    loads = cluster.decode.load()["remote_kv_loads"]
    estimated = metric(cluster.router, "ember_router_cached_tokens_estimated_total")
    reported = metric(cluster.router, "ember_router_cached_tokens_reported_total")
    # OpenCode's shape: a system prompt, content as text parts, streamed with usage.
    messages: list[dict] = [
        {"role": "system", "content": long_text(60, 300)},
        {"role": "user", "content": [{"type": "text", "text": "list the files"}]},
    ]
    usages: list[dict] = []
    for turn in range(3):
        text, usage = stream(
            cluster.router, "/chat/completions", chat_body("", messages=messages, max_tokens=8),
            headers,
        )  # fmt: skip
        usages.append(usage)
        wait_router_caught_up(cluster.router, cluster.engines())
        messages = [
            *messages,
            {"role": "assistant", "content": text},
            {"role": "user", "content": [{"type": "text", "text": long_text(turn, 40)}]},
        ]
    added = [
        b["prompt_tokens"] - a["prompt_tokens"] for a, b in zip(usages, usages[1:], strict=False)
    ]
    assert all(0 < n < 256 for n in added), added  # short turns: under --disagg-min-uncached
    for before, usage in zip(usages, usages[1:], strict=False):
        # The turn before's prompt is cached, up to its last (partial) block.
        covered = (before["prompt_tokens"] // BLOCK - 1) * BLOCK
        assert usage["prompt_tokens_details"]["cached_tokens"] >= covered, usages
    moved = {s.url: s.load()["prefix_cache_queries"] - queries[s.url] for s in cluster.prefill}
    assert sorted(v > 0 for v in moved.values()) == [False, True], moved  # one prefill engine
    assert cluster.decode.load()["remote_kv_loads"] - loads == 3  # every turn took a prefill leg
    # The router's estimate is what the engine then found (the index was caught up each turn).
    assert metric(cluster.router, "ember_router_cached_tokens_estimated_total") - estimated == (
        metric(cluster.router, "ember_router_cached_tokens_reported_total") - reported
    )


def test_a_queue_longer_than_the_stall_timeout_ends_in_answers(cluster: PDCluster) -> None:
    """Twelve requests at once on engines that take one at a time: most wait in a queue far
    longer than the router's stall timeout (0.5 s). Each is an answer; none a 503, none cut."""
    router = start_router(None, cluster.prefill, [cluster.decode], extra=["--stall-timeout", "0.5"])
    try:

        def one(i: int) -> tuple[str, dict]:
            body = chat_body(long_text(100 + i, 300), max_tokens=16)
            if i % 2:
                r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=300)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["message"]["content"], r.json()["usage"]
            return stream(router, "/chat/completions", body)

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            results = list(pool.map(one, range(12)))
        assert [u["completion_tokens"] for _, u in results] == [16] * 12
        assert metric(router, "ember_router_failures_total") == 0
    finally:
        router.stop()


def test_tokenize_and_detokenize_through_the_router(cluster: PDCluster, llama: Path) -> None:
    router = start_router(llama, cluster.prefill, [cluster.decode], extra=["--api-key", KEY])
    try:
        auth = {"authorization": f"Bearer {KEY}"}
        tokenizer = Tokenizer.from_dir(llama)
        text = long_text(7, 30)
        r = httpx.post(
            f"{router.url}/tokenize", json={"model": "tiny", "prompt": text}, headers=auth
        )
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=True)
        assert r.json()["count"] == len(r.json()["tokens"])
        # A conversation as OpenCode sends it: the router's own reading of the prompt (what
        # its prefix index hashes) is the engine's, token for token.
        chat = {
            "model": "tiny",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c", "extra": 1},
            ],
        }  # fmt: skip
        r = httpx.post(f"{router.url}/tokenize", json=chat, headers=auth)
        assert r.status_code == 200, r.text
        assert PromptReader(str(llama)).read(chat, True).token_ids == r.json()["tokens"]
        ids = r.json()["tokens"]
        r = httpx.post(
            f"{router.url}/detokenize", json={"model": "tiny", "tokens": ids}, headers=auth
        )
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == tokenizer.decode(ids, False)
        for path in ("/tokenize", "/detokenize"):  # a public route: the API key is needed
            r = httpx.post(f"{router.url}{path}", json={"model": "tiny", "prompt": "x"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    finally:
        router.stop()


def shape(r: httpx.Response) -> tuple[int, str, type | None, type | None]:
    """What must be alike on every error: status, type, and `code` a string or null."""
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] is None or isinstance(err["code"], str), err
    assert r.headers["content-type"].startswith("application/json")
    return r.status_code, err["type"], type(err["param"]), type(err["code"])


def test_every_router_error_has_the_engines_shape(
    cluster: PDCluster, llama: Path, procs: Processes
) -> None:
    engine = start_server(llama, *ENGINE, "--max-body-bytes", "4000", api_key=KEY)
    router = start_router(
        llama,
        cluster.prefill,
        [cluster.decode],
        extra=["--api-key", KEY, "--max-body-bytes", "4000"],
    )
    try:
        auth = {"authorization": f"Bearer {KEY}"}
        cases = {
            "401": lambda s: httpx.post(f"{s.url}/v1/chat/completions", json=chat_body("x")),
            "404 route": lambda s: httpx.get(f"{s.url}/v1/nope", headers=auth),
            "404 model": lambda s: httpx.post(
                f"{s.url}/v1/chat/completions", json=chat_body("x", model="nope"), headers=auth
            ),
            "405": lambda s: httpx.get(f"{s.url}/v1/chat/completions", headers=auth),
            "413": lambda s: httpx.post(
                f"{s.url}/v1/chat/completions", json=chat_body("x" * 5000), headers=auth
            ),
            "400 JSON": lambda s: httpx.post(
                f"{s.url}/v1/chat/completions", content=b"{nope", headers=auth
            ),
        }
        for name, call in cases.items():
            got, want = call(router), call(engine)
            assert want.status_code == int(name[:3]), (name, want.text)
            assert shape(got)[:2] == shape(want)[:2], (name, got.text, want.text)
    finally:
        engine.stop()
        router.stop()
    # 503: no endpoint answers; 500: an unhandled error (here, an engine's malformed prefill
    # answer, whose usage is not an object). Scripted engines stand in for both.
    dead = procs.engine()
    router = procs.router(decode=[dead])
    dead.stop()
    r = httpx.post(f"{router.url}/v1/chat/completions", json=chat_body("x"), timeout=30)
    assert shape(r)[:2] == (503, "server_error"), r.text

    async def malformed(_request, _body):  # noqa: ANN001, ANN202
        from aiohttp import web

        return web.json_response({"kv_transfer_params": {}, "usage": [1]})

    prefill = procs.engine(role="prefill", reply=malformed)
    router = procs.router(prefill=[prefill], decode=[procs.engine(role="decode")])
    body = chat_body("x")
    r = httpx.post(f"{router.url}/v1/chat/completions", json=body, headers={"x-session-id": "s"})
    assert shape(r)[:2] == (500, "server_error"), r.text
    assert orjson.loads(r.content)["error"]["message"] == "internal error in the router"
