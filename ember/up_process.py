"""A whole cluster for a benchmark or a test: `ember up` as a child process, started and waited
for until its router routes to every engine, stopped as ember up stops its own children; and the
wait, once load stops, for its engines to hold nothing (benchmarks/soak.py, tests/test_chaos.py,
the client-shape tests, the disaggregation fault tests)."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

from ember.cluster import get_load, stop_processes, wait_routed
from ember.trust import SECRET_ENV


@contextmanager
def up_process(
    model: str,
    port: int,
    *flags: str,
    secret: str,
    log: Path | None = None,
    ready_timeout_s: float = 300.0,
    grace_s: float = 30.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """`ember up MODEL --port PORT *flags` as a child process: logging at ERROR, stdout dropped,
    stderr appended to `log` (else ours). Yields once the router routes to every engine (a
    RuntimeError with the log's tail if ember up exits or times out first); on leaving, SIGTERM,
    then SIGKILL after `grace_s`."""
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ember.cli", "up", model, "--port", str(port), *flags]
    env = {**os.environ, SECRET_ENV: secret, "EMBER_LOG_LEVEL": "ERROR"}
    # A file, not a pipe: a cluster that logs a lot must never block on a full pipe.
    with log.open("ab") if log else nullcontext() as err:
        popen = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        try:
            wait_routed(url, secret, ready_timeout_s, popen)
        except (RuntimeError, TimeoutError) as e:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            raise RuntimeError(f"ember up at {url} did not come up: {e}\n{tail}") from e
        yield popen
    finally:
        stop_processes([popen], grace_s)


def drained(load: Mapping[str, object]) -> bool:
    """Whether an engine's /load shows it holding nothing: no request running, no KV lease lent,
    every KV block free (a cached block counts as free)."""
    return (
        load.get("running") == 0
        and load.get("leases") == 0
        and load.get("free_blocks", -1) == load.get("total_blocks")
    )


def wait_drained(
    engine_urls: Sequence[str], secret: str, timeout_s: float = 30.0
) -> dict[str, dict]:
    """Until every engine is `drained`, as each must be once load stops (aborted requests and
    leases take a moment to settle), or `timeout_s` passes. Returns each engine's last /load;
    one that did not answer (a busy engine may answer slowly: asked again until the deadline)
    as {"error": why}."""
    deadline = time.monotonic() + timeout_s
    while True:
        state: dict[str, dict] = {}
        for url in engine_urls:
            try:
                state[url] = get_load(url, secret)
            except (OSError, ValueError, http.client.HTTPException) as e:
                state[url] = {"error": repr(e)}
        if all(drained(s) for s in state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)
