"""Engine and router processes on loopback, for tests that talk to them over HTTP."""

from __future__ import annotations

import argparse
import contextlib
import random
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from ember.cluster import spawn, stop_processes
from ember.trust import SECRET_ENV, internal_headers

SECRET = "test-cluster-secret"
"""The cluster secret every test engine and router shares (internal routes need it)."""


_PORTS = random.Random()


def free_port(run: int = 1) -> int:
    """A port free now, below the kernel's ephemeral range (32768 and up on Linux): servers
    started together take their ports a moment after picking them, and a port from the ephemeral
    range could meanwhile go to another process's outgoing or auto-bound socket (a PD test's
    server once found its port taken by its sibling's transfer engine). `run`: the first of that
    many consecutive free ports (`ember up --engine-port` numbers its engines from it; a chaos
    test once found the third taken)."""
    for _ in range(200):
        port = _PORTS.randrange(20000, 32768 - run)
        with contextlib.ExitStack() as held:
            try:
                for p in range(port, port + run):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no {run} free ports in a row in 20000-32767")


@dataclass
class Server:
    url: str
    model: str
    proc: subprocess.Popen
    api_key: str | None = None

    @property
    def base(self) -> str:
        return f"{self.url}/v1"

    def client(self, **kw):  # noqa: ANN201 - openai.OpenAI
        import openai

        kw.setdefault("api_key", self.api_key or "none")
        return openai.OpenAI(base_url=self.base, max_retries=0, **kw)

    def load(self) -> dict:
        return httpx.get(f"{self.url}/load", headers=internal_headers(SECRET), timeout=5).json()

    def stop(self) -> None:
        stop_processes([self.proc], 20)


def start_server(
    model_dir: Path,
    *extra: str,
    api_key: str | None = None,
    wait: bool = True,
    env: Mapping[str, str] | None = None,
) -> Server:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        "serve", str(model_dir), "--port", str(port), "--served-model-name", "tiny",
        "--max-model-len", "1024", "--log-level", "warning", *extra,
    ]  # fmt: skip
    if api_key:
        args += ["--api-key", api_key]
    env = {"EMBER_LOG_LEVEL": "WARNING", SECRET_ENV: SECRET, **(env or {})}
    proc = spawn("serve", url, args, env).popen
    server = Server(url, "tiny", proc, api_key)
    if wait:
        wait_healthy(server)
    return server


def wait_healthy(server: Server, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError("server did not become healthy")


def start_router(
    model_dir: Path | None,
    prefill: Sequence[Server] = (),
    decode: Sequence[Server] = (),
    both: Sequence[Server] = (),
    extra: Sequence[str] = (),
) -> Server:
    """`ember router` over running engines, polling them every 0.2 s."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["router", "--port", str(port), "--poll-interval", "0.2", "--log-level", "warning"]
    args += extra
    if model_dir is not None:
        args += ["--model", str(model_dir)]
    for flag, servers in (("--prefill", prefill), ("--decode", decode), ("--both", both)):
        if servers:
            args += [flag, *(s.url for s in servers)]
    router = Server(url, "tiny", spawn("router", url, args, {SECRET_ENV: SECRET}).popen)
    wait_healthy(router)
    wait_router_caught_up(router, [*prefill, *decode, *both])
    return router


def wait_router_caught_up(router: Server, engines: Sequence[Server], timeout_s: float = 30) -> None:
    """Until the router sees every engine healthy and its prefix index has applied every KV event
    each engine has published (router /load `kv_event_seq` == engine /load `kv_event_seq`).
    Waiting on the state, not a fixed sleep, keeps tests right on a slow or loaded machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        want = {e.url: e.load().get("kv_event_seq", 0) for e in engines}
        seen = {
            ep["url"]: ep["kv_event_seq"]
            for ep in router.load()["endpoints"]
            if ep["healthy"] and ep["url"] in want
        }
        if seen == want:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"router index behind the engines: {seen} vs {want}")
        time.sleep(0.05)


@dataclass
class PDCluster:
    """Prefill engines and a decode engine behind `ember router`: disaggregation, end to end."""

    prefill: list[Server]
    decode: Server
    router: Server

    def engines(self) -> list[Server]:
        """The engines behind the router."""
        return [*self.prefill, self.decode]


@contextmanager
def pd_cluster(model_dir: Path, *engine_args: str, prefill: int = 2) -> Iterator[PDCluster]:
    """`prefill` prefill engines and one decode engine, each `ember serve *engine_args`, started
    together, and a router over them once all answer; every process stopped on leaving."""
    servers: list[Server] = []
    try:
        for role in ["prefill"] * prefill + ["decode"]:
            servers.append(start_server(model_dir, *engine_args, "--role", role, wait=False))
        for s in servers:
            wait_healthy(s)
        servers.append(start_router(model_dir, prefill=servers[:prefill], decode=servers[-1:]))
        yield PDCluster(servers[:prefill], servers[prefill], servers[-1])
    finally:
        stop_processes([s.proc for s in reversed(servers)], 20)  # the router first


def spawned_by_up(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], **start: object
) -> tuple[argparse.Namespace, dict[str, list[str]]]:
    """`ember up argv`'s parsed arguments and the command line it would give each process
    (router and engines, by name), without starting any: `start` goes to `start_cluster` (e.g. a
    store address)."""
    import ember.cluster as cluster

    spawned: dict[str, list[str]] = {}

    def record(name: str, url: str, args: list[str], env: object = None) -> SimpleNamespace:
        spawned[name] = list(args)
        return SimpleNamespace(name=name, url=url)

    monkeypatch.setattr(cluster, "spawn", record)
    p = argparse.ArgumentParser()
    cluster.add_up_args(p)
    args = p.parse_args(argv)
    cluster.start_cluster(args, argv[0], "secret", **start)
    return args, spawned
