"""`ember serve --tensor-parallel-size 2` on the CPU: it answers as one engine, and a worker
killed under it ends the server with a non-zero status within seconds (for `ember up` or a
supervisor to restart), leaving no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx

from tests.servers import start_server


def worker_pids() -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", "ember.engine.worker_main"], capture_output=True, text=True
    )
    return [int(p) for p in out.stdout.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_a_killed_worker_ends_the_server(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    before = set(worker_pids())
    server = start_server(tiny_model_dir("llama"), "--tensor-parallel-size", "2")
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        ours = [p for p in worker_pids() if p not in before]
        assert len(ours) == 1
        os.kill(ours[0], signal.SIGKILL)
        t0 = time.monotonic()
        code = server.proc.wait(timeout=30)
        assert code != 0
        assert time.monotonic() - t0 < 20
        assert not any(alive(p) for p in ours)
    finally:
        server.stop()
