"""`ember up`: engines and a router as subprocesses, healthy, answering, and gone after SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.servers import free_port

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")


def up(model: str, port: int, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "ember.cli", "up", model, "--port", str(port), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def three_free_ports() -> int:
    """A port whose next two are free as well (ember up numbers its engines after the router)."""
    for _ in range(50):
        port = free_port()
        if not any(listening(p) or not bindable(p) for p in (port + 1, port + 2)):
            return port
    raise RuntimeError("no three consecutive free ports")


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_up_answers_a_streamed_request_through_prefill_and_decode(tiny_model_dir) -> None:
    port = three_free_ports()
    proc = up(str(tiny_model_dir("llama")), port, "--demo", "--exit-after-demo")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert f"ember is up: http://127.0.0.1:{port}" in out
    answer = [ln for ln in out.splitlines() if ln.startswith("demo answer: ")]
    assert answer and len(answer[0]) > len("demo answer: ''")
    assert '"completion_tokens": 24' in out
    for p in (port, port + 1, port + 2):
        assert not listening(p), f"port {p} still served after ember up exited"


def test_sigterm_stops_every_process(tiny_model_dir) -> None:
    port = three_free_ports()
    proc = up(str(tiny_model_dir("llama")), port)
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        if line.startswith("ember is up"):
            break
        assert time.monotonic() < deadline
    assert all(listening(p) for p in (port, port + 1, port + 2))
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert proc.returncode == 0
    for p in (port, port + 1, port + 2):
        assert not listening(p), f"port {p} still served after SIGTERM"
