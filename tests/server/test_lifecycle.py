"""Faults and shutdown: a client that hangs up frees every block at once; SIGTERM drains."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import pytest

from tests.server.conftest import Server

LONG = 7000  # tokens: ~20 s of generation on the CPU, so a hang-up lands mid-request and only an
# abort frees the blocks within FREED_S (kept well above a loaded CI machine's stalls)
FREED_S = 3.0


@pytest.fixture(scope="module")
def long_server(server_factory) -> Server:
    return server_factory("--max-model-len", "8192")


def test_disconnect_mid_stream_frees_everything_at_once(long_server: Server) -> None:
    server = long_server
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{server.base}/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        # Keep the iterator referenced: dropping it would close the connection right here.
        lines = r.iter_lines()
        data = [line for line, _ in zip(lines, range(10), strict=False) if line.startswith("data:")]
        assert len(data) == 5
        load = server.load()
        assert load["running"] == 1 and load["free_blocks"] < load["total_blocks"]
    # Leaving the block closes the connection mid-stream.
    deadline = time.monotonic() + FREED_S
    while True:
        load = server.load()
        if (
            load["running"] == 0
            and load["waiting"] == 0
            and load["free_blocks"] == load["total_blocks"]
        ):
            break
        assert time.monotonic() < deadline, f"blocks still held after {FREED_S} s: {load}"
        time.sleep(0.02)
    assert load["in_flight"] == 0


def test_disconnect_while_waiting_for_a_whole_response(long_server: Server) -> None:
    server = long_server
    body = json.dumps(
        {"model": "tiny", "prompt": "x " * 50, "max_tokens": LONG, "ignore_eos": True}
    ).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    deadline = time.monotonic() + 5
    while server.load()["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sock.close()
    deadline = time.monotonic() + FREED_S
    while (load := server.load())["free_blocks"] != load["total_blocks"] or load["running"]:
        assert time.monotonic() < deadline, f"blocks still held after {FREED_S} s: {load}"
        time.sleep(0.02)


def test_sigterm_drains_in_flight_streams_then_exits(server_factory) -> None:
    s: Server = server_factory("--drain-timeout", "20")
    body = {
        "model": "tiny",
        "prompt": "once upon",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    received = []
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{s.base}/completions", json=body) as r,
    ):
        for i, line in enumerate(r.iter_lines()):
            if i == 3:
                s.proc.send_signal(signal.SIGTERM)
                time.sleep(0.3)
                # New connections are refused (or told to go away) while draining.
                try:
                    h = httpx.get(f"{s.url}/health", timeout=2)
                    assert h.status_code == 503
                except httpx.TransportError:
                    pass
            if line:
                received.append(line)
    assert received[-1] == "data: [DONE]"
    texts = [json.loads(x[6:]) for x in received if x.startswith("data: {")]
    assert texts[-1]["choices"][0]["finish_reason"] == "length"
    # uvicorn re-raises the captured SIGTERM once drained, so the exit status is the signal's.
    assert s.proc.wait(30) in (0, -signal.SIGTERM)


def test_health_is_503_while_loading(server_factory, tmp_path) -> None:
    # The engine core starts with the API process (ember/engine/core_spawn.py) and the tiny
    # model loads before HTTP is up: hold the core back 3 s (a sitecustomize that only the
    # spawned process, started with --multiprocessing-fork, acts on).
    (tmp_path / "sitecustomize.py").write_text(
        "import sys, time\nif '--multiprocessing-fork' in sys.argv:\n    time.sleep(3)\n"
    )
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    s: Server = server_factory(wait=False, env={"PYTHONPATH": path})
    seen = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{s.url}/health", timeout=1)
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        seen.add(r.status_code)
        if r.status_code == 200:
            break
        assert r.json() == {"status": "loading"}
        time.sleep(0.05)
    assert 200 in seen and 503 in seen
