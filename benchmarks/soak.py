"""Soak: `ember up` (prefill + decode engines behind the router, tiny model, CPU, loopback) under N
minutes of mixed load: agent-like streamed chats, whole completions, clients that hang up mid-stream
and hostile bodies. Prints requests ok / rejected / failed, the count of 5xx answers, leaked KV blocks
and leases once the load stops, and each process's RSS at start, at its peak during the load, at
the load's end and `--settle-s` after it (the goal: back within 10% of the start); writes JSON.

    python benchmarks/soak.py [--minutes 2] [--concurrency 16] [--prefill 1] [--decode 1]

Writes benchmarks/results/soak-cpu-<date>.json (or `--out DIR`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.result_names import result_path  # noqa: E402
from ember.cluster import get_load  # noqa: E402
from ember.trust import new_secret  # noqa: E402
from ember.up_process import up_process, wait_drained  # noqa: E402

SYSTEM = "You are a coding agent. Tools: read_file, write_file, run. " * 40
HOSTILE: list[Any] = [
    {"messages": [{"role": "user", "content": "hi"}], "top_k": 2**63},
    {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64 - 1, "n": 2},
    {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [2**70]},
    {"messages": [{"role": "user", "content": "\ud800"}]},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": float("nan")},
    {"messages": [{"role": "user", "content": "hi"}], "n": 10**9},
    {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 10**6},
    {"messages": []},
    {"messages": "not a list"},
    {"prompt": [[1, 2, 3]] * 20000, "n": 4},
    {"prompt": [10**12]},
    {
        "messages": [{"role": "user", "content": "hi"}],
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "block_ids": [0, 1],
            "release_url": "http://127.0.0.1:9/x",
        },
    },  # noqa: E501
    {
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": json.loads('{"items":' * 300 + "{}" + "}" * 300),
            },
        },
    },
    [1, 2, 3],
    "null",
]


def children_of(pid: int) -> list[int]:
    """Every descendant of `pid`, from /proc (no psutil here)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def label(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    words = [w.decode(errors="replace") for w in cmd if w]
    if "router" in words:
        return "router"
    if "serve" in words and "--role" in words:
        port = words[words.index("--port") + 1] if "--port" in words else "?"
        return f"{words[words.index('--role') + 1]}:{port}"
    if any("resource_tracker" in w for w in words):
        return "resource-tracker"
    if any("multiprocessing" in w or "spawn_main" in w for w in words):
        return "engine-core"
    return " ".join(words[-3:])


class Soak:
    def __init__(self, url: str, args: argparse.Namespace, minutes: float | None = None) -> None:
        self.url = url
        self.args = args
        self.minutes = args.minutes if minutes is None else minutes
        self.counts: Counter[str] = Counter()
        self.status: Counter[int] = Counter()
        self.rng = random.Random(args.seed)

    async def worker(self, session: aiohttp.ClientSession, wid: int, deadline: float) -> None:
        turn = 0
        history = [{"role": "system", "content": SYSTEM}]
        while time.monotonic() < deadline:
            r = self.rng.random()
            try:
                if r < 0.5:
                    turn += 1
                    history.append({"role": "user", "content": f"step {turn} of task {wid}"})
                    text = await self.chat(session, history, f"ses_{wid}", hang_up=False)
                    history.append({"role": "assistant", "content": text or "ok"})
                    if len(history) > 12:
                        history = history[:1]
                elif r < 0.65:
                    await self.completion(session)
                elif r < 0.8:
                    await self.chat(session, history, f"ses_{wid}", hang_up=True)
                else:
                    await self.hostile(session)
            except (TimeoutError, aiohttp.ClientError) as e:
                self.counts["failed"] += 1
                self.counts[f"failed: {type(e).__name__}"] += 1

    async def chat(
        self, session: aiohttp.ClientSession, messages: list[dict], sid: str, hang_up: bool
    ) -> str:
        body = {"messages": messages, "max_tokens": 24, "stream": True}
        text = []
        async with session.post(
            f"{self.url}/v1/chat/completions", json=body, headers={"x-session-affinity": sid}
        ) as resp:
            self.status[resp.status] += 1
            if resp.status != 200:
                self.counts["rejected" if resp.status < 500 else "failed"] += 1
                return ""
            chunks = 0
            done = error = False
            async for line in resp.content:
                if hang_up and chunks >= self.rng.randint(1, 4):
                    self.counts["hung up"] += 1
                    return ""  # leaving the block closes the connection mid-stream
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: {"):
                    chunks += 1
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        error = True
                    for c in obj.get("choices", []):
                        text.append((c.get("delta") or {}).get("content") or "")
            self.counts["ok" if done and not error else "failed"] += 1
            if error:
                self.counts["failed: error event"] += 1
        return "".join(text)

    async def completion(self, session: aiohttp.ClientSession) -> None:
        body = {
            "prompt": "def main():" * self.rng.randint(1, 60),
            "max_tokens": 16,
        }
        async with session.post(f"{self.url}/v1/completions", json=body) as resp:
            self.status[resp.status] += 1
            await resp.read()
            self.counts[
                "ok" if resp.status == 200 else "rejected" if resp.status < 500 else "failed"
            ] += 1

    async def hostile(self, session: aiohttp.ClientSession) -> None:
        body = self.rng.choice(HOSTILE)
        path = (
            "/v1/completions"
            if isinstance(body, dict) and "prompt" in body
            else "/v1/chat/completions"
        )
        data = json.dumps(body) if not isinstance(body, str) else body
        async with session.post(
            f"{self.url}{path}", data=data.encode("utf-8", "surrogatepass"),
            headers={"content-type": "application/json"},
        ) as resp:  # fmt: skip
            self.status[resp.status] += 1
            raw = await resp.read()
            if resp.status >= 500 or b"Traceback" in raw:
                self.counts["failed"] += 1
                self.counts["failed: hostile got 5xx"] += 1
            elif resp.status == 200:
                self.counts["ok"] += 1  # e.g. kv_transfer_params from a client: ignored, served
            else:
                shaped = isinstance(json.loads(raw).get("error"), dict)
                self.counts["rejected" if shaped else "failed"] += 1

    async def run(self, sample: Callable[[], None] = lambda: None) -> None:
        """The load until the deadline; `sample()` is called every second meanwhile."""
        deadline = time.monotonic() + self.minutes * 60
        timeout = aiohttp.ClientTimeout(total=120)

        async def sampler() -> None:
            while time.monotonic() < deadline:
                sample()
                await asyncio.sleep(1.0)

        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(
                sampler(),
                *(self.worker(session, i, deadline) for i in range(self.args.concurrency)),
            )


def sample_peak(peak: dict[int, float | None], pids: list[int]) -> None:
    for p in pids:
        now = rss_mib(p)
        if now is not None and (peak.get(p) is None or now > (peak[p] or 0)):
            peak[p] = now


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--settle-s", type=float, default=60.0, help="RSS is read again this long after the load"
    )
    ap.add_argument(
        "--warmup-s",
        type=float,
        default=20.0,
        help="a first load this long, before the RSS the load is compared with (lazy imports, "
        "first compilations and caches of bounded size are not what the soak looks for)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = ap.parse_args()
    secret = new_secret()
    from ember.models.tiny import ensure_tiny

    # The tiny model, as the README's soak table was measured (ember up's default is SmolLM2).
    model = str(ensure_tiny("llama"))
    flags = ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    url = f"http://127.0.0.1:{args.port}"
    with up_process(model, args.port, *flags, secret=secret) as up:
        engines = [e["url"] for e in get_load(url, secret)["endpoints"]]
        pids = children_of(up.pid)
        rss_fresh = {p: rss_mib(p) for p in pids}
        names = {p: label(p) for p in pids}
        if args.warmup_s > 0:
            asyncio.run(Soak(url, args, minutes=args.warmup_s / 60).run())
            wait_drained(engines, secret)
            time.sleep(min(args.settle_s, 15.0))  # the trim of the warm-up's garbage
        rss0 = {p: rss_mib(p) for p in pids}
        soak = Soak(url, args)
        peak = dict(rss0)
        t0 = time.monotonic()
        asyncio.run(soak.run(lambda: sample_peak(peak, pids)))
        elapsed = time.monotonic() - t0
        # Let aborted requests and leases settle, then count what is still held.
        state = wait_drained(engines, secret)
        rss1 = {p: rss_mib(p) for p in pids}
        time.sleep(args.settle_s)
        rss2 = {p: rss_mib(p) for p in pids}
        alive = up.poll() is None
    unanswered = [e for e, s in state.items() if "error" in s]
    leaked = {e: s.get("total_blocks", 0) - s.get("free_blocks", 0) for e, s in state.items()}
    leases = {e: s.get("leases", 0) for e, s in state.items()}
    five = sum(n for code, n in soak.status.items() if code >= 500)
    result = {
        "minutes": elapsed / 60,
        "concurrency": args.concurrency,
        "counts": dict(soak.counts),
        "status": {str(k): v for k, v in sorted(soak.status.items())},
        "http_5xx": five,
        "leaked_blocks": leaked,
        "leases_held": leases,
        "engines_unanswered": unanswered,
        "cluster_alive": alive,
        "settle_s": args.settle_s,
        "warmup_s": args.warmup_s,
        "rss_mib": {
            f"{names[p]} ({p})": {
                "fresh": rss_fresh[p],
                "start": rss0[p],
                "peak": peak.get(p),
                "end": rss1.get(p),
                "settled": rss2.get(p),
            }
            for p in pids
            if rss0[p]
        },
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = result_path("soak", "cpu", out_dir=args.out)
    out.write_text(json.dumps(result, indent=2))
    c = soak.counts
    print(
        f"soak: {elapsed / 60:.1f} min, {args.concurrency} clients, {args.prefill}P + {args.decode}D"
    )
    print("| requests ok | rejected (4xx) | failed | hung up | 5xx | leaked blocks | leases held |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {c['ok']} | {c['rejected']} | {c['failed']} | {c['hung up']} | {five} | "
        f"{sum(leaked.values())} | {sum(leases.values())} |"
    )
    print(
        f"\n| process | RSS fresh MiB | after warm-up (start) | peak | end | "
        f"{args.settle_s:.0f} s later | later / start |\n|---|---|---|---|---|---|---|"
    )
    for name, r in result["rss_mib"].items():
        keys = ("fresh", "start", "peak", "end", "settled")
        cells = ["gone" if r[k] is None else f"{r[k]:.0f}" for k in keys]
        ratio = "" if r["settled"] is None else f"{r['settled'] / r['start']:.2f}"
        print(f"| {name} | {' | '.join(cells)} | {ratio} |")
    fails = {k: v for k, v in c.items() if k.startswith("failed:")}
    if fails:
        print(f"failures: {fails}")
    if unanswered:
        print(f"no /load answer after the load: {unanswered}")
    print(f"wrote {out}")
    ok = five == 0 and not c["failed"] and not sum(leaked.values()) and not sum(leases.values())
    return 0 if ok and alive and not unanswered else 1


if __name__ == "__main__":
    sys.exit(main())
