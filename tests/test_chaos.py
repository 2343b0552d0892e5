"""Chaos: `ember up` with 2 prefill engines and 1 decode engine under streamed load with random client
hang-ups; one prefill engine is killed with SIGKILL, the other frozen with SIGSTOP for longer than
the router's stall timeout, then thawed. No request that a healthy engine could serve fails, no
stream hangs, the killed engine is restarted, and every KV block and lease is free at the end."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from ember.cluster import router_endpoints
from ember.up_process import drained, up_process, wait_drained
from tests.servers import free_port

SECRET = "chaos-secret"
STALL_S = 5


def serve_pid(port: int) -> int | None:
    """The pid of the `ember serve` API process listening on `port` (from /proc cmdlines)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            words = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in words and b"--port" in words:
            i = words.index(b"--port")
            if i + 1 < len(words) and words[i + 1] == str(port).encode():
                return int(d.name)
    return None


class Client(threading.Thread):
    """Streams chat requests until told to stop; hangs up on some of them on purpose."""

    def __init__(self, url: str, seed: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.rng, self.stop = url, random.Random(seed), stop
        self.ok = self.hung_up = 0
        self.failures: list[str] = []
        self.longest_s = 0.0

    def run(self) -> None:
        with httpx.Client(timeout=httpx.Timeout(60, connect=5)) as http:
            turn = 0
            while not self.stop.is_set():
                turn += 1
                hang = self.rng.random() < 0.25
                body = {
                    # Long enough (> the 256-token threshold) to be split into two legs.
                    "messages": [{"role": "user", "content": f"turn {turn}: " + "word " * 400}],
                    "max_tokens": 12,
                    "stream": True,
                }
                t0 = time.monotonic()
                try:
                    with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                        if r.status_code != 200:
                            self.failures.append(f"HTTP {r.status_code}: {r.read()[:200]!r}")
                            continue
                        done = False
                        for n, line in enumerate(r.iter_lines()):
                            if hang and n >= 1:
                                break
                            if '"error"' in line:
                                self.failures.append(f"error event: {line[:200]}")
                            done = done or line.startswith("data: [DONE]")
                        if hang:
                            self.hung_up += 1
                        elif done:
                            self.ok += 1
                        else:
                            self.failures.append("stream ended without [DONE]")
                except httpx.HTTPError as e:
                    self.failures.append(f"{type(e).__name__}: {e}")
                self.longest_s = max(self.longest_s, time.monotonic() - t0)


@pytest.mark.slow
def test_kill_and_freeze_engines_under_load(tiny_model_dir, tmp_path: Path) -> None:
    port = free_port()
    first_engine = free_port(run=3)  # two prefill engines and a decode one, in a row
    url = f"http://127.0.0.1:{port}"
    flags = [
        "--prefill", "2", "--decode", "1", "--engine-port", str(first_engine),
        "--stall-timeout", str(STALL_S), "--kv-timeout", "1.5", "--max-model-len", "1024",
    ]  # fmt: skip
    prefill_ports = [first_engine, first_engine + 1]
    engines = [f"http://127.0.0.1:{p}" for p in [*prefill_ports, first_engine + 2]]
    model = str(tiny_model_dir("llama"))
    log = tmp_path / "up.log"
    with up_process(model, port, *flags, secret=SECRET, log=log, ready_timeout_s=120) as up:
        stop = threading.Event()
        clients = [Client(url, seed, stop) for seed in range(3)]
        try:
            for c in clients:
                c.start()
            time.sleep(3)
            killed = serve_pid(prefill_ports[0])
            frozen = serve_pid(prefill_ports[1])
            assert killed and frozen
            os.kill(killed, signal.SIGKILL)
            time.sleep(1)
            os.kill(frozen, signal.SIGSTOP)
            time.sleep(STALL_S * 2 + 1)  # longer than the stall timeout
            os.kill(frozen, signal.SIGCONT)
            # The killed engine comes back (a new process on the same port), and the router
            # sees it.
            deadline = time.monotonic() + 90
            while True:
                pid = serve_pid(prefill_ports[0])
                try:
                    healthy = all(e["healthy"] for e in router_endpoints(url, SECRET))
                except (OSError, ValueError, KeyError):
                    healthy = False
                if pid is not None and pid != killed and healthy:
                    break
                assert time.monotonic() < deadline, "the killed engine was not restarted"
                time.sleep(0.5)
            time.sleep(3)  # some traffic through the restarted cluster
        finally:
            stop.set()
            for c in clients:
                c.join(90)
        assert not any(c.is_alive() for c in clients), "a client hangs"
        failures = [f for c in clients for f in c.failures]
        assert not failures, failures
        assert sum(c.ok for c in clients) >= 10
        assert max(c.longest_s for c in clients) < 30, "a stream took too long"
        state = wait_drained(engines, SECRET)
        assert all(drained(s) for s in state.values()), f"blocks or leases still held: {state}"
        assert up.poll() is None, "ember up stopped"
    assert up.returncode == 0, log.read_text()[-4000:]
