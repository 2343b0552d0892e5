"""Colocated against disaggregated serving of the tiny model on the CPU, under a small agentic load.

Two clusters of two engines each behind `ember router`, started one after the other with
`ember up`'s own code: two colocated engines (`--both 2`), then one prefill and one decode engine.
The load: S sessions at once, each T turns; every turn resends the shared system prompt, the
session's history and a new tool result, streamed, greedy, `x-session-affinity` set. Reports TTFT,
ITL (p50/p90), output tokens/s and the prompt-cache hit ratio, prints a table, writes JSON.

    python benchmarks/pd_cpu.py [--sessions 8 --turns 3]

On a 2-core machine the engines share the cores with each other and with the client, so this
measures the machinery's overheads (the extra leg, the KV read), not the interference that
disaggregation removes on GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ember.cluster import start_cluster, stop_cluster, wait_healthy  # noqa: E402
from ember.models.tiny import ensure_tiny  # noqa: E402

WORDS = ["agent", "tool", "call", "result", "file", "read", "write", "test", "patch", "diff"]


def text(seed: int, n: int) -> str:
    return " ".join(f"{WORDS[(seed + i * i) % len(WORDS)]}{i % 17}" for i in range(n))


SYSTEM = "You are a coding agent. Tools: read_file, write_file, run_tests. " + text(0, 250)


async def session(
    client: httpx.AsyncClient, url: str, model: str, sid: int, turns: int, out: list
) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text(sid, 60)}]
    for turn in range(turns):
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": 32,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        stamps, answer, usage = [], [], {}
        headers = {"x-session-affinity": f"ses_{sid}"}
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers
        ) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk.get("choices", []):
                    if c["delta"].get("content"):
                        stamps.append(time.perf_counter())
                        answer.append(c["delta"]["content"])
        out.append(
            {
                "session": sid,
                "turn": turn,
                "ttft_s": stamps[0] - t0 if stamps else None,
                "itl_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
                "e2e_s": time.perf_counter() - t0,
                "prompt_tokens": usage.get("prompt_tokens", 0),
                "completion_tokens": usage.get("completion_tokens", 0),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            }
        )
        messages += [
            {"role": "assistant", "content": "".join(answer)},
            {"role": "user", "content": "tool result: " + text(sid * 31 + turn, 120)},
        ]


async def load(url: str, model: str, sessions: int, turns: int) -> tuple[list[dict], float]:
    out: list[dict] = []
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(session(client, url, model, s, turns, out) for s in range(sessions)))
        return out, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(records: list[dict], wall: float) -> dict[str, float]:
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    itl = [x for r in records for x in r["itl_s"]]
    prompt = sum(r["prompt_tokens"] for r in records)
    return {
        "requests": len(records),
        "ttft_p50_ms": pct(ttft, 0.5) * 1e3,
        "ttft_p90_ms": pct(ttft, 0.9) * 1e3,
        "itl_p50_ms": pct(itl, 0.5) * 1e3,
        "itl_p90_ms": pct(itl, 0.9) * 1e3,
        "e2e_mean_s": statistics.mean(r["e2e_s"] for r in records),
        "output_tok_s": sum(r["completion_tokens"] for r in records) / wall,
        "cache_hit_ratio": sum(r["cached_tokens"] for r in records) / max(prompt, 1),
        "wall_s": wall,
    }


def run_config(name: str, model: str, port: int, args: argparse.Namespace, **roles: int) -> dict:
    ns = argparse.Namespace(
        prefill=roles.get("prefill", 0), decode=roles.get("decode", 0), both=roles.get("both", 0),
        host="127.0.0.1", port=port, engine_port=None, device="cpu", max_model_len=4096,
        kv_transport="mooncake", disagg_min_uncached=256,
    )  # fmt: skip
    procs = start_cluster(ns, model)
    try:
        wait_healthy(procs, 300)
        time.sleep(1.0)
        records, wall = asyncio.run(load(procs[-1].url, model, args.sessions, args.turns))
    finally:
        stop_cluster(procs)
    return {"config": name, "summary": summarize(records, wall), "records": records}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--port", type=int, default=18100)
    args = ap.parse_args()
    model = str(ensure_tiny("llama"))
    results = [
        run_config("colocated (2 x both)", model, args.port, args, both=2),
        run_config("disaggregated (1 prefill + 1 decode)", model, args.port + 10, args, prefill=1, decode=1),
    ]  # fmt: skip
    cpu = f"cpu-{platform.machine()}-{os.cpu_count()}cores"
    print(f"\n{args.sessions} sessions x {args.turns} turns, tiny llama, {cpu}")
    print("| config | TTFT p50 / p90 ms | ITL p50 / p90 ms | output tok/s | cache hit |")
    print("|---|---|---|---|---|")
    for r in results:
        s = r["summary"]
        print(
            f"| {r['config']} | {s['ttft_p50_ms']:.0f} / {s['ttft_p90_ms']:.0f} | "
            f"{s['itl_p50_ms']:.1f} / {s['itl_p90_ms']:.1f} | {s['output_tok_s']:.0f} | "
            f"{s['cache_hit_ratio']:.2f} |"
        )
    out = Path(os.environ.get("OUT") or "benchmarks/results") / f"pd_cpu-{cpu}.json"
    out.write_text(json.dumps({"sessions": args.sessions, "turns": args.turns, "results": results}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
