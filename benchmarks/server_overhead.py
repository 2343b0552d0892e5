"""What the HTTP and IPC layers cost per token: the tiny model on the CPU, N concurrent streams
through `ember serve` against the same engine driven in-process.

Prints a table and writes
benchmarks/results/server_overhead-cpu-<date>.json (or `--out DIR`). Reports requests/s, SSE events/s and
tokens/s both ways, the wall-time overhead per token, and the CPU seconds the API process (HTTP,
tokenizer, detokenizer, SSE) and the engine-core process spent per token.

    .venv/bin/python benchmarks/server_overhead.py [--streams 64] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import time
from pathlib import Path

import httpx
import torch
from result_names import result_path

from ember import LLM, SamplingParams
from ember.cluster import spawn, stop_cluster, wait_healthy
from ember.models.tiny import ensure_tiny

CLK = os.sysconf("SC_CLK_TCK")
EXTRA_ENV = json.loads(os.environ.get("BENCH_SERVER_ENV", "{}"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        out += [int(k) for k in kids]
    return out


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_in_process(model: str, ps: list[list[int]], tokens: int) -> dict[str, float]:
    llm = LLM(model, max_model_len=1024, enable_prefix_caching=False)
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(ps[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(ps, params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "wall_s": wall,
        "tokens": n,
        "requests_per_s": len(ps) / wall,
        "tokens_per_s": n / wall,
        "cpu_s_per_token": cpu / n,
    }


async def stream_one(
    client: httpx.AsyncClient, url: str, prompt: list[int], tokens: int
) -> tuple[int, int]:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 1.0,
    }
    events = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events += 1
    return events, tokens


async def run_clients(url: str, ps: list[list[int]], tokens: int) -> tuple[float, int, int]:
    limits = httpx.Limits(max_connections=len(ps) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await stream_one(client, url, ps[0], 4)  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream_one(client, url, p, tokens) for p in ps))
        wall = time.perf_counter() - t0
    return wall, sum(e for e, _ in results), sum(t for _, t in results)


def run_server(model: str, ps: list[list[int]], tokens: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [
        "serve", model, "--port", str(port), "--served-model-name", "m",
        "--max-model-len", "1024", "--no-prefix-caching", "--log-level", "warning",
    ]  # fmt: skip
    server = spawn("serve", f"http://127.0.0.1:{port}", args, EXTRA_ENV)
    try:
        wait_healthy([server], 60)
        pid = server.popen.pid
        core = children(pid)
        api0 = cpu_seconds(pid)
        core0 = sum(cpu_seconds(p) for p in core)
        wall, events, n = asyncio.run(run_clients(f"{server.url}/v1/completions", ps, tokens))
        api_cpu = cpu_seconds(pid) - api0
        core_cpu = sum(cpu_seconds(p) for p in core) - core0
    finally:
        stop_cluster([server], 30)
    return {
        "wall_s": wall,
        "tokens": n,
        "sse_events": events,
        "requests_per_s": len(ps) / wall,
        "sse_events_per_s": events / wall,
        "tokens_per_s": n / wall,
        "api_cpu_s_per_token": api_cpu / n,
        "core_cpu_s_per_token": core_cpu / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    model = str(ensure_tiny(args.arch))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    ps = prompts(args.streams, args.prompt_tokens, vocab)
    inproc = run_in_process(model, ps, args.tokens)
    served = run_server(model, ps, args.tokens)
    overhead_ms = (served["wall_s"] - inproc["wall_s"]) / served["tokens"] * 1e3
    print(f"{args.streams} streams x {args.tokens} tokens, tiny {args.arch}, CPU")
    print("| path | requests/s | tokens/s | SSE events/s | CPU ms/token |")
    print("|---|---|---|---|---|")
    print(
        f"| in-process LLM | {inproc['requests_per_s']:.1f} | {inproc['tokens_per_s']:.0f} | - "
        f"| {inproc['cpu_s_per_token'] * 1e3:.3f} |"
    )
    print(
        f"| ember serve | {served['requests_per_s']:.1f} | {served['tokens_per_s']:.0f} | "
        f"{served['sse_events_per_s']:.0f} | API {served['api_cpu_s_per_token'] * 1e3:.3f} + "
        f"core {served['core_cpu_s_per_token'] * 1e3:.3f} |"
    )
    print(
        f"wall overhead per token: {overhead_ms:.3f} ms; server/in-process tokens/s: "
        f"{served['tokens_per_s'] / inproc['tokens_per_s']:.2f}"
    )
    machine = f"cpu-{platform.machine()}-{os.cpu_count()}cores"
    out = result_path("server_overhead", "cpu", out_dir=args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "server_overhead",
                "machine": machine,
                "torch": torch.__version__,
                "model": f"tiny-{args.arch}",
                "streams": args.streams,
                "tokens": args.tokens,
                "in_process": inproc,
                "server": served,
                "wall_overhead_ms_per_token": overhead_ms,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
