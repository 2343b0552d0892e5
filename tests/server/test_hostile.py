"""The engine's API edge against hostile clients: every field
range-checked before the core sees it, admission by sequences, no blocked event loop, paged
/kv_events, and no connection that can hold the server without sending its headers."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from ember.trust import internal_headers
from tests.server.conftest import Server
from tests.server.hostile_cases import (
    CHAT,
    COMPLETION,
    MAY_SUCCEED,
    chat_cases,
    completion_cases,
    encode,
)
from tests.servers import SECRET

JSON = {"content-type": "application/json"}


def post(server: Server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, content=encode(body), headers=JSON, timeout=timeout)


def assert_openai_error(r: httpx.Response) -> None:
    assert "Traceback" not in r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] is None or isinstance(err["code"], str)
    assert err["type"] in {"invalid_request_error", "authentication_error", "not_found_error",
                           "rate_limit_error", "server_error"}  # fmt: skip


@pytest.fixture(scope="module")
def edge_server(server_factory) -> Server:
    return server_factory("--max-model-len", "256", "--max-num-seqs", "8", "--max-waiting", "8")


@pytest.mark.parametrize(
    ("path", "cases"),
    [("/v1/chat/completions", chat_cases()), ("/v1/completions", completion_cases())],
    ids=["chat", "completions"],
)
def test_hostile_values_get_a_400_never_a_5xx(edge_server: Server, path: str, cases) -> None:
    wrong: list[str] = []
    for name, body in cases:
        r = post(edge_server, path, body)
        if r.status_code != 200 or name not in MAY_SUCCEED:
            if r.status_code != 400:
                wrong.append(f"{name}: {r.status_code} {r.text[:120]}")
                continue
            assert_openai_error(r)
    assert not wrong, "\n".join(wrong)
    assert httpx.get(f"{edge_server.url}/health", timeout=5).status_code == 200
    base = CHAT if path.endswith("chat/completions") else COMPLETION
    ok = post(edge_server, path, {**base, "top_k": 5, "seed": 1})
    assert ok.status_code == 200, ok.text


def test_admission_counts_sequences_not_requests(server_factory) -> None:
    # max_num_seqs 8 + max_waiting 8 = 16 sequences at once; a long context keeps some in flight.
    edge_server = server_factory(
        "--max-model-len", "2048", "--max-num-seqs", "8", "--max-waiting", "8"
    )
    many = post(edge_server, "/v1/completions", {"prompt": ["a"] * 20_000, "n": 4})
    assert many.status_code == 400 and "prompts" in many.json()["error"]["message"]
    never = post(edge_server, "/v1/completions", {"prompt": ["a"] * 5, "n": 4, "max_tokens": 1})
    assert never.status_code == 400, never.text
    assert never.json()["error"]["code"] == "too_many_sequences"
    body = {"prompt": ["a", "b", "c"], "n": 4, "max_tokens": 2000, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{edge_server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as held:  # 12 sequences in flight, in one request
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped generator would close the stream
        next(lines)
        busy = post(edge_server, "/v1/completions", {"prompt": "x", "n": 5, "max_tokens": 1})
        assert busy.status_code == 429, busy.text
        assert_openai_error(busy)
    # The held request's sequences were freed when it was closed: room again.
    fits = post(edge_server, "/v1/completions", {"prompt": "x", "n": 16, "max_tokens": 1})
    assert fits.status_code == 200, fits.text


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(edge_server: Server) -> None:
    start = time.monotonic()
    r = post(edge_server, "/v1/completions", {"prompt": "word " * 800_000})  # 4 MB
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - start < 1.0  # tokenizing it took 3.9 s


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmRSS"))) / 1024


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/tokenize", {"prompt": "word " * 800_000}, 400, "context_length_exceeded"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "word " * 800_000}]},
            400,
            "context_length_exceeded",
        ),
        ("/detokenize", {"tokens": [5] * 300}, 400, None),  # more ids than max_model_len (256)
        ("/detokenize", {"tokens": [5] * 1_000_000}, 413, "request_too_large"),
    ],
    ids=["text", "chat", "ids", "body"],
)
def test_tokenize_and_detokenize_are_bounded(
    edge_server: Server, path: str, body: dict, status: int, code: str | None
) -> None:
    """Before: /tokenize had no limit (two 30 MB bodies took the API process from 1.5 to 11.4 GB
    and 4.2 GB stayed)."""
    before = rss_mb(edge_server.proc.pid)
    start = time.monotonic()
    r = post(edge_server, path, body)
    assert r.status_code == status, r.text
    assert_openai_error(r)
    assert code is None or r.json()["error"]["code"] == code
    assert time.monotonic() - start < 2.0
    assert rss_mb(edge_server.proc.pid) - before < 200
    ok = post(edge_server, "/detokenize", {"tokens": [5, 6, 7]})
    assert ok.status_code == 200 and ok.json()["prompt"]


def test_health_answers_while_a_large_prompt_is_tokenized(server_factory) -> None:
    # A context long enough that 1.5 MB of text is worth tokenizing (then refused as too long).
    server = server_factory("--max-model-len", "32768")
    text = " ".join(f"w{i % 5000} x{i % 7}" for i in range(150_000))
    worst = 0.0
    done = threading.Event()

    def big() -> None:
        try:
            r = post(server, "/v1/completions", {"prompt": text}, timeout=120)
            assert r.status_code == 400, r.text
        finally:
            done.set()

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.3)
    probes = 0
    while not done.is_set():
        t = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - t)
        probes += 1
        time.sleep(0.05)
    thread.join()
    assert probes >= 5  # the tokenizing really overlapped the probes
    assert worst < 0.5, f"/health took {worst:.2f} s while a prompt was tokenized"


def test_kv_events_are_paged(edge_server: Server) -> None:
    for i in range(3):
        prompt = " ".join(f"page{i} token{j}" for j in range(20))
        assert post(edge_server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).is_success
    newest = edge_server.load()["kv_event_seq"]
    assert newest > 6
    url, headers = f"{edge_server.url}/kv_events", internal_headers(SECRET)
    first = httpx.get(url, params={"since": 0, "limit": 2}, headers=headers).json()
    assert len(first["events"]) == 2 and first["seq"] == 2 and first["more"] is True
    seen, since = 2, 2
    while True:
        page = httpx.get(url, params={"since": since, "limit": 4}, headers=headers).json()
        seen += len(page["events"])
        since = page["seq"]
        if not page["more"]:
            break
    assert since >= newest and seen == since
    bad = httpx.get(url, params={"limit": 10**9}, headers=headers)
    assert bad.status_code == 400
    assert_openai_error(bad)


def _slow_client(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")  # never ends
    return s


def _closed(s: socket.socket) -> bool:
    """Whether the server closed the connection (EOF or reset) within 5 s."""
    s.settimeout(5)
    try:
        while s.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_slow_headers_are_cut_and_connections_capped(server_factory) -> None:
    server = server_factory("--header-timeout", "2", "--max-connections", "230")
    limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
    soft, hard = next(ln.split()[3:5] for ln in limits.splitlines() if "open files" in ln)
    assert soft == hard  # raised to the hard limit at start
    slow = [_slow_client(server.url) for _ in range(200)]
    try:
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        # Past the cap a new connection is told so at once (OpenAI-shaped) and closed.
        extra = [_slow_client(server.url) for _ in range(40)]
        answers = []
        for s in extra:
            s.settimeout(1.5)
            try:
                answers.append(s.recv(4096))
            except TimeoutError:
                answers.append(b"")
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        assert refused, "no connection past --max-connections was refused"
        body = json.loads(refused[0].split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "too_many_connections"
        time.sleep(2.5)  # past the header timeout: every slow connection is closed
        assert all(_closed(s) for s in slow)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    finally:
        for s in slow:
            s.close()
