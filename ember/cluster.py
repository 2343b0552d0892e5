"""`ember up`: a local cluster in one command. Prefill and decode engines (`ember serve --role ...`)
and a router in front of them, each its own subprocess; waits until all are healthy, prints the URL
and an example request, and stops them all on Ctrl-C or SIGTERM (or when one of them dies).

`spawn`, `wait_healthy`, `wait_routed` and `stop_cluster` also start and stop the servers of the
benchmarks (benchmarks/server_overhead.py, pd_gpu.py, pd_cpu.py)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="model directory (default: tiny llama)")
    p.add_argument("--prefill", type=int, default=1, help="prefill engines")
    p.add_argument("--decode", type=int, default=1, help="decode engines")
    p.add_argument("--both", type=int, default=0, help="colocated engines")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--engine-port", type=int, default=None, help="first engine port (port + 1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-transport", default="mooncake", choices=["mooncake", "cuda_ipc"])
    p.add_argument("--disagg-min-uncached", type=int, default=256)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument(
        "--demo", action="store_true", help="once up, send one streamed chat request and print it"
    )
    p.add_argument(
        "--exit-after-demo", action="store_true", help="stop the cluster after the demo request"
    )


@dataclass(slots=True)
class Proc:
    name: str
    url: str
    popen: subprocess.Popen[bytes]


def spawn(name: str, url: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> Proc:
    """`python -m ember.cli *args` as a child process (logging at WARNING unless the caller's
    EMBER_LOG_LEVEL or `env` says otherwise); `url` is where it will answer."""
    level = os.environ.get("EMBER_LOG_LEVEL", "WARNING")
    full_env = {**os.environ, "EMBER_LOG_LEVEL": level, **(env or {})}
    cmd = [sys.executable, "-m", "ember.cli", *args]
    return Proc(name, url, subprocess.Popen(cmd, env=full_env))


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_cluster(args: argparse.Namespace, model: str) -> list[Proc]:
    """Start the engines and the router; returns them, router last (not yet healthy)."""
    engines = [("prefill", args.prefill), ("decode", args.decode), ("both", args.both)]
    total = sum(n for _, n in engines)
    if total == 0 or args.decode + args.both == 0:
        raise ValueError("ember up needs at least one decode or colocated engine")
    threads = max(1, ((os.cpu_count() or 2) - 1) // total)
    port = args.engine_port or args.port + 1
    procs: list[Proc] = []
    urls: dict[str, list[str]] = {"prefill": [], "decode": [], "both": []}
    for role, n in engines:
        for i in range(n):
            url = f"http://{args.host}:{port}"
            cmd = (
                "serve", model, "--host", args.host, "--port", str(port), "--role", role,
                "--device", args.device, "--max-model-len", str(args.max_model_len),
                "--kv-transport", args.kv_transport, "--kv-host", args.host,
                "--cpu-threads", str(threads), "--log-level", "warning",
            )  # fmt: skip
            procs.append(spawn(f"{role}-{i}", url, cmd))
            urls[role].append(url)
            port += 1
    rcmd = [
        "router", "--host", args.host, "--port", str(args.port), "--model", model,
        "--disagg-min-uncached", str(args.disagg_min_uncached), "--log-level", "warning",
    ]  # fmt: skip
    for role, found in urls.items():
        if found:
            rcmd += [f"--{role}", *found]
    procs.append(spawn("router", f"http://{args.host}:{args.port}", rcmd))
    return procs


def wait_healthy(procs: list[Proc], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = list(procs)
    while waiting:
        for p in list(waiting):
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode} while starting")
            if _healthy(p.url):
                waiting.remove(p)
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy after {timeout_s:.0f} s: {[p.name for p in waiting]}")
        time.sleep(0.3)


def wait_routed(router_url: str, timeout_s: float = 60.0) -> None:
    """Until the router has marked every engine behind it healthy (its /health answers once a
    decode-capable engine is up; a prefill engine it has not polled yet would get no traffic)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{router_url}/load", timeout=2) as r:
                endpoints = json.load(r)["endpoints"]
            if endpoints and all(e["healthy"] for e in endpoints):
                return
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router at {router_url} has unhealthy engines")
        time.sleep(0.1)


def stop_cluster(procs: list[Proc], grace_s: float = 10.0) -> None:
    for p in reversed(procs):  # the router first: no new requests reach dying engines
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()


def demo_request(url: str, model: str) -> str:
    """One streamed chat request through the router; returns the streamed text."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello to the cluster. " * 80}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json", "x-session-affinity": "ses_demo"},
    )
    text = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message"))
            for c in chunk.get("choices", []):
                text.append(c.get("delta", {}).get("content") or "")
            if chunk.get("usage"):
                print(f"usage: {json.dumps(chunk['usage'])}")
    return "".join(text)


def run_cluster(args: argparse.Namespace) -> int:
    from ember.models.tiny import ensure_tiny

    model = args.model or str(ensure_tiny("llama"))
    if not Path(model).is_dir():
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    procs = start_cluster(args, model)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        wait_healthy(procs, args.ready_timeout)
        router = procs[-1].url
        wait_routed(router)
        print(f"ember is up: {router}  (engines: {', '.join(p.url for p in procs[:-1])})")
        print(
            f"  curl {router}/v1/chat/completions -H 'content-type: application/json' "
            f'-H \'x-session-affinity: ses_1\' -d \'{{"model": "{model}", "messages": '
            '[{"role": "user", "content": "hi"}], "stream": true}\''
        )
        if args.demo:
            print(f"demo answer: {demo_request(router, model)!r}", flush=True)
            if args.exit_after_demo:
                return 0
        print("Ctrl-C stops the cluster.", flush=True)
        while not stopping:
            dead = [p for p in procs if p.popen.poll() is not None]
            if dead:
                print(f"{dead[0].name} exited ({dead[0].popen.returncode}); stopping", flush=True)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        stop_cluster(procs)
